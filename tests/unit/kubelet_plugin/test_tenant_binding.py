"""A free shared GPU goes to one namespace before any pod is bound (binding conditions): it
is published with TenantReady/TenantTaken while free and without them once held; of claims of
several namespaces allocated on it at once, the oldest allocation's namespace gets it and the
others are sent back; a prepared record, a claim allocated while the tenant was published and
a claim already told TenantReady each hold the GPU; a decided claim is not decided again
(also after a restart); a claim that leaves frees the GPU; a claim with a partition and a
share gets both outcomes in one status; prepare keeps TenantReady true."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

from flexgpu.driver.names import (
    DRIVER_NAME,
    PARTITION_FAILED_CONDITION,
    PARTITION_READY_CONDITION,
    TENANT_READY_CONDITION,
    TENANT_TAKEN_CONDITION,
)
from flexgpu.driver.node_policy import GpuMode
from flexgpu.kubelet_plugin.agents.binding_watch import (
    CLAIMS,
    REQUEUE_AFTER_S,
    RESEND_FIRST_S,
    BindingWatch,
)
from flexgpu.kubelet_plugin.api.kube_api import ApiError
from flexgpu.kubelet_plugin.claims.claim_source import claim_path
from flexgpu.kubelet_plugin.claims.claim_status import ClaimStatusWriter
from flexgpu.kubelet_plugin.claims.early_partitions import EarlyPartitions
from flexgpu.kubelet_plugin.claims.tenant_attribute import TenantAttribute
from tests.conftest import wait_for
from tests.unit.kubelet_plugin.fake_kube_api import FakeKubeApi
from tests.unit.kubelet_plugin.prepare_support import (
    DYNAMIC_GPU,
    NODE,
    SHARED_GPU,
    ClaimTable,
    Node,
    share,
)

GPU = f"gpu-{SHARED_GPU}"
# A second shared GPU, for the tests of claims allocated anew.
OTHER_SHARED = SHARED_GPU + 1
OTHER_GPU = f"gpu-{OTHER_SHARED}"
PART = f"gpu-{DYNAMIC_GPU}-mig-1g10gb-3"


def result(device: str, share_id: str | None, conditions: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"request": "gpu", "driver": DRIVER_NAME, "pool": NODE, "device": device}
    if share_id is not None:
        out["shareID"] = share_id
        out["consumedCapacity"] = {"memory": "8Gi"}
    if conditions:
        out["bindingConditions"] = conditions
        failure = {
            TENANT_READY_CONDITION: TENANT_TAKEN_CONDITION,
            PARTITION_READY_CONDITION: PARTITION_FAILED_CONDITION,
        }
        out["bindingFailureConditions"] = [failure[c] for c in conditions]
    return out


def shared_claim(
    name: str,
    namespace: str,
    at: str,
    *,
    waits: bool = True,
    extra: Any = (),
    gpu: str = GPU,
) -> dict[str, Any]:
    """A claim allocated a share of the shared GPU at time ``at`` (with the tenant binding
    condition when the GPU was free, ``waits``)."""
    conditions = [TENANT_READY_CONDITION] if waits else []
    results = [result(gpu, f"s-{name}", conditions), *extra]
    return {
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "status": {
            "allocation": {"devices": {"results": results}, "allocationTimestamp": at},
        },
    }


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class World:
    def __init__(self, tmp_path: Path, claims: list[Any], node: Node | None = None) -> None:
        self.clock = Clock()
        self.node = node or Node(tmp_path, ClaimTable())
        self.node.devices.binding_conditions = True
        self.node.devices.publish_tenants = True
        self.node.devices.refresh()
        self.api = FakeKubeApi()
        self.api.lists[CLAIMS] = claims
        for claim in claims:
            meta = claim["metadata"]
            self.api.put_object(claim_path(meta["namespace"], meta["name"]), copy.deepcopy(claim))
        self.writer = ClaimStatusWriter(self.api, NODE)
        self.published: list[list[dict[str, Any]]] = []
        self._events: Any = None
        self.record_reads = 0
        self.requeues = 0
        self.attribute = TenantAttribute(
            self.node.preparer.load_checkpoint, self.node.devices, self._republish
        )
        self.watch = BindingWatch(
            self.api,  # type: ignore[arg-type]
            NODE,
            early=EarlyPartitions(self.node.preparer),
            status=self.writer,
            devices=self.node.devices,
            republish=self._republish,
            failure_s=60,
            records=self._records,
            tenants_changed=self.attribute.update,
            requeue=self._requeue,
            clock=self.clock,
        )
        self.attribute.held = self.watch.tenants.holders
        self.watch.ensure_watch()
        assert self.watch.claims.wait_synced(5)

    def _requeue(self) -> None:
        self.requeues += 1

    def _records(self) -> Any:
        self.record_reads += 1
        return self.node.preparer.load_checkpoint().claims.values()

    def _republish(self) -> None:
        self.published.append(self.node.devices.slice_devices())

    def pass_once(self) -> None:
        self.watch.process()
        self.writer.flush()

    def conditions(self, namespace: str, name: str) -> list[tuple[str, str, str]]:
        status = self.api.objects[claim_path(namespace, name)].get("status") or {}
        return [
            (entry["device"], c["type"], c["status"])
            for entry in status.get("devices") or []
            for c in entry["conditions"]
        ]

    def shared_device(self) -> dict[str, Any]:
        (device,) = [d for d in self.node.devices.slice_devices() if d["name"] == GPU]
        return device

    def send(self, event: str, obj: dict[str, Any]) -> None:
        if self._events is None:
            self._events = self.api.watches.get(timeout=5)
        meta = obj["metadata"]
        self.api.put_object(claim_path(meta["namespace"], meta["name"]), copy.deepcopy(obj))
        self._events.put((event, obj))

    def stop(self) -> None:
        self.watch.claims.stop()


READY = (GPU, TENANT_READY_CONDITION, "True")
TAKEN = (GPU, TENANT_TAKEN_CONDITION, "True")


def test_a_free_shared_gpu_carries_the_tenant_conditions_and_a_held_one_does_not(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, ClaimTable())
    node.devices.publish_tenants = True
    node.devices.refresh()
    (off,) = [d for d in node.devices.slice_devices() if d["name"] == GPU]
    assert "bindingConditions" not in off, "no binding conditions on this release: none"

    node.devices.binding_conditions = True
    (free,) = [d for d in node.devices.slice_devices() if d["name"] == GPU]
    assert free["attributes"]["tenant"] == {"string": ""}
    assert free["bindingConditions"] == [TENANT_READY_CONDITION]
    assert free["bindingFailureConditions"] == [TENANT_TAKEN_CONDITION]
    assert "bindsToNode" not in free, "the device is on this node's own slice already"

    assert node.devices.set_tenants({SHARED_GPU: "team-a"})
    (held,) = [d for d in node.devices.slice_devices() if d["name"] == GPU]
    assert held["attributes"]["tenant"] == {"string": "team-a"}
    assert "bindingConditions" not in held and "bindingFailureConditions" not in held
    # Only the shared GPU: whole GPUs are a claim's alone.
    assert "bindingConditions" not in next(
        d for d in node.devices.slice_devices() if d["name"] == "gpu-0"
    )


def test_the_oldest_allocation_gets_a_free_gpu_and_other_namespaces_are_sent_back(
    tmp_path: Path,
) -> None:
    world = World(
        tmp_path,
        [
            shared_claim("b1", "team-b", "2026-12-02T10:00:02Z"),
            shared_claim("a1", "team-a", "2026-12-02T10:00:01Z"),
            shared_claim("a2", "team-a", "2026-12-02T10:00:03Z"),
        ],
    )
    try:
        world.pass_once()
        assert world.conditions("team-a", "a1") == [READY]
        assert world.conditions("team-a", "a2") == [READY]
        assert world.conditions("team-b", "b1") == [TAKEN]
        status = world.api.objects[claim_path("team-b", "b1")]["status"]["devices"][0]
        assert status["shareID"] == "s-b1"
        message = status["conditions"][0]["message"]
        assert "another namespace" in message and "team-a" not in message
        # The tenant went out with the first decision, dropping the conditions.
        device = world.shared_device()
        assert device["attributes"]["tenant"] == {"string": "team-a"}
        assert "bindingConditions" not in device
        assert world.published[-1] == world.node.devices.slice_devices()

        # Decided: another pass writes nothing more, and reads no records (it runs on every
        # change of a kept claim).
        writes, reads, published = world.writer.writes, world.record_reads, len(world.published)
        world.pass_once()
        assert world.writer.writes == writes
        assert world.record_reads == reads and len(world.published) == published
    finally:
        world.stop()


def test_a_prepared_claim_of_another_namespace_holds_the_gpu(tmp_path: Path) -> None:
    node = Node(tmp_path, ClaimTable())
    ref = node.table.add("x", share(GPU, "s-x", "8Gi"), namespace="team-x")
    assert node.preparer.prepare([ref])[ref.uid].error == ""
    world = World(tmp_path, [shared_claim("b", "team-b", "2026-12-02T10:00:00Z")], node)
    try:
        world.pass_once()
        assert world.conditions("team-b", "b") == [TAKEN]
        assert world.shared_device()["attributes"]["tenant"] == {"string": "team-x"}
    finally:
        world.stop()


def test_a_claim_allocated_while_the_tenant_was_published_holds_the_gpu(tmp_path: Path) -> None:
    """Allocated without the conditions (the GPU then served its namespace) and not prepared
    yet: still the GPU's tenant, so another namespace's waiting claim is sent back."""
    world = World(
        tmp_path,
        [
            shared_claim("a", "team-a", "2026-12-02T10:00:00Z", waits=False),
            shared_claim("b", "team-b", "2026-12-02T10:00:05Z"),
        ],
    )
    try:
        world.pass_once()
        assert world.conditions("team-b", "b") == [TAKEN]
        assert world.conditions("team-a", "a") == [], "nothing to decide for it"
        assert world.shared_device()["attributes"]["tenant"] == {"string": "team-a"}
    finally:
        world.stop()


def test_after_a_restart_a_claim_told_tenant_ready_holds_the_gpu_and_is_not_rewritten(
    tmp_path: Path,
) -> None:
    told = shared_claim("a", "team-a", "2026-12-02T10:00:00Z")
    entry = {
        "driver": DRIVER_NAME,
        "pool": NODE,
        "device": GPU,
        "shareID": "s-a",
        "conditions": [{"type": TENANT_READY_CONDITION, "status": "True"}],
    }
    told["status"]["devices"] = [entry]
    world = World(tmp_path, [told, shared_claim("b", "team-b", "2026-12-02T10:00:01Z")])
    try:
        world.pass_once()
        assert world.conditions("team-b", "b") == [TAKEN]
        assert world.conditions("team-a", "a") == [READY]
        assert world.writer.writes == 1, "only b's outcome was written"
        assert world.shared_device()["attributes"]["tenant"] == {"string": "team-a"}
    finally:
        world.stop()


def test_a_claim_that_leaves_frees_the_gpu_for_the_next_namespace(tmp_path: Path) -> None:
    world = World(tmp_path, [shared_claim("a", "team-a", "2026-12-02T10:00:00Z")])
    try:
        world.pass_once()
        assert world.shared_device()["attributes"]["tenant"] == {"string": "team-a"}
        gone = shared_claim("a", "team-a", "2026-12-02T10:00:00Z")
        gone["status"] = {}
        world.send("MODIFIED", gone)
        wait_for(lambda: not world.watch.claims.items(), timeout_s=5, what="claim dropped")
        world.pass_once()
        device = world.shared_device()
        assert device["attributes"]["tenant"] == {"string": ""}
        assert device["bindingConditions"] == [TENANT_READY_CONDITION]

        world.send("ADDED", shared_claim("b", "team-b", "2026-12-02T10:01:00Z"))
        wait_for(lambda: bool(world.watch.claims.items()), timeout_s=5, what="claim b seen")
        world.pass_once()
        assert world.conditions("team-b", "b") == [READY]
        assert world.shared_device()["attributes"]["tenant"] == {"string": "team-b"}
    finally:
        world.stop()


def test_a_claim_with_a_partition_and_a_share_gets_both_outcomes(tmp_path: Path) -> None:
    partition = result(PART, None, [PARTITION_READY_CONDITION])
    world = World(
        tmp_path, [shared_claim("c", "team-c", "2026-12-02T10:00:00Z", extra=[partition])]
    )
    try:
        world.pass_once()
        found = world.conditions("team-c", "c")
        assert READY in found and (PART, PARTITION_READY_CONDITION, "True") in found
        assert len(found) == 2
    finally:
        world.stop()


def test_a_claim_sent_back_gets_no_partition_made(tmp_path: Path) -> None:
    partition = result(PART, None, [PARTITION_READY_CONDITION])
    world = World(
        tmp_path,
        [
            shared_claim("a", "team-a", "2026-12-02T10:00:00Z"),
            shared_claim("b", "team-b", "2026-12-02T10:00:01Z", extra=[partition]),
        ],
    )
    try:
        world.pass_once()
        assert world.conditions("team-b", "b") == [TAKEN]
        assert world.node.backend.list_mig_devices(DYNAMIC_GPU) == []
    finally:
        world.stop()


def test_prepare_keeps_tenant_ready_true_for_the_claims_next_pods(tmp_path: Path) -> None:
    """The scheduler checks a claim's binding conditions for every pod that uses it, and
    prepare's status write replaces the entry the binding watch wrote."""
    node = Node(tmp_path, ClaimTable())
    node.devices.binding_conditions = True
    node.devices.publish_tenants = True
    api = FakeKubeApi()
    claim = shared_claim("a", "team-a", "2026-12-02T10:00:00Z")
    api.put_object(claim_path("team-a", "a"), claim)
    writer = ClaimStatusWriter(api, NODE)
    node.preparer._status = writer
    waiting = replace(share(GPU, "s-a", "8Gi"), binding_conditions=(TENANT_READY_CONDITION,))
    ref = node.table.add("a", waiting, namespace="team-a")
    assert node.preparer.prepare([ref])[ref.uid].error == ""
    writer.flush()
    (entry,) = api.objects[claim_path("team-a", "a")]["status"]["devices"]
    types = {c["type"]: c["status"] for c in entry["conditions"]}
    assert types == {"Ready": "True", TENANT_READY_CONDITION: "True"}


def test_claims_are_watched_for_shared_gpus_only_where_the_conditions_are_published(
    tmp_path: Path,
) -> None:
    """A node whose only reason to watch is a shared GPU watches claims while free shared
    GPUs carry the conditions, and stops once namespaces may share or the GPU is whole."""
    world = World(tmp_path, [shared_claim("a", "team-a", "2026-12-02T10:00:00Z")])
    devices = world.node.devices
    try:
        devices.set_modes({SHARED_GPU: GpuMode.SHARED})  # no on-demand MIG GPU left
        world.watch.ensure_watch()
        assert devices.tenant_binding() and world.watch.claims.synced
        assert [o["metadata"]["name"] for o in world.watch.claims.items()] == ["a"]

        devices.publish_tenants = False  # namespaces may share: nothing to decide
        world.watch.ensure_watch()
        lists = world.api.count("GET")
        world.watch.process()
        assert world.api.count("GET") == lists, "no watch, no reads"
        assert world.conditions("team-a", "a") == [], "nothing decided"

        devices.publish_tenants = True
        devices.binding_conditions = False  # a release without binding conditions
        assert not devices.tenant_binding()
        devices.binding_conditions = True
        devices.set_modes({})  # the shared GPU made whole: no shared GPU left
        assert not devices.tenant_binding()
    finally:
        world.stop()


def test_a_claim_sent_back_and_allocated_anew_gets_only_its_new_devices_outcome(
    tmp_path: Path,
) -> None:
    """Sent back from one shared GPU (TenantTaken), the claim is allocated on another: the
    write for its new device carries no entry of the first one (the API server refuses an
    entry of a device not allocated), so its pod is bound."""
    node = Node(tmp_path, ClaimTable(), shared=frozenset({SHARED_GPU, OTHER_SHARED}))
    world = World(
        tmp_path,
        [
            shared_claim("a", "team-a", "2026-12-02T10:00:00Z"),
            shared_claim("b", "team-b", "2026-12-02T10:00:01Z"),
        ],
        node,
    )
    try:
        world.pass_once()
        assert world.conditions("team-b", "b") == [TAKEN]
        # The scheduler takes the allocation back (the server drops status.devices with it)
        # and allocates the other shared GPU, still free.
        again = shared_claim("b", "team-b", "2026-12-02T10:00:09Z", gpu=OTHER_GPU)
        world.send("MODIFIED", again)
        wait_for(
            lambda: OTHER_GPU in str(world.watch.claims.items()),
            timeout_s=5,
            what="claim b allocated anew",
        )
        world.pass_once()
        assert world.conditions("team-b", "b") == [(OTHER_GPU, TENANT_READY_CONDITION, "True")]
        assert world.writer.refused == 0
    finally:
        world.stop()


def test_a_refused_decision_is_written_again_paced_and_built_anew(tmp_path: Path) -> None:
    """A decision whose write did not reach the claim is written again once no write of it
    is queued: not on every pass (the watch wakes on every claim change), but after
    RESEND_FIRST_S, from a fresh read of the claim."""
    world = World(tmp_path, [shared_claim("a", "team-a", "2026-12-02T10:00:00Z")])
    try:
        refused = ApiError(422, "Invalid", "status.devices[0]: refused for the test")
        world.api.fail_writes = [refused, refused]  # as written, then as built anew
        world.pass_once()
        assert world.conditions("team-a", "a") == []
        assert world.writer.refused == 1
        writes = world.writer.writes
        world.pass_once()
        assert world.writer.writes == writes, "written again at once"
        world.clock.now += RESEND_FIRST_S
        world.pass_once()
        assert world.conditions("team-a", "a") == [READY]
    finally:
        world.stop()


def test_slices_are_written_again_once_the_tenant_ready_pods_left_prebind(tmp_path: Path) -> None:
    """While pods wait in PreBind the scheduler counts their claims' capacity twice and finds
    fractions that fit unschedulable; only a ResourceSlice update retries those. So once the
    scheduler has had its poll after a TenantReady, the node's slices are written again, once;
    a claim sent back (TenantTaken) alone asks for nothing."""
    world = World(
        tmp_path,
        [
            shared_claim("a1", "team-a", "2026-12-02T10:00:00Z"),
            shared_claim("b1", "team-b", "2026-12-02T10:00:01Z"),
        ],
    )
    try:
        world.pass_once()
        assert world.conditions("team-a", "a1") == [READY]
        assert world.requeues == 0, "not before the scheduler's poll"
        world.clock.now += REQUEUE_AFTER_S
        world.pass_once()
        assert world.requeues == 1
        world.clock.now += REQUEUE_AFTER_S
        world.pass_once()
        assert world.requeues == 1, "once per decision"
    finally:
        world.stop()
