"""The binding-conditions watch against an in-memory API server: only claims waiting on this
node are kept, their partitions are made and PartitionReady written; a failure writes
PartitionFailed and taints the GPU's partitions until the cool-down ends; a claim that stops
waiting has its partition destroyed. Also what the slices carry, and the server probe."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from flexgpu.driver.names import (
    DRIVER_NAME,
    PARTITION_FAILED_CONDITION,
    PARTITION_FAILED_TAINT,
    PARTITION_READY_CONDITION,
)
from flexgpu.kubelet_plugin.agents.binding_watch import (
    CLAIMS,
    BindingWatch,
    server_keeps_binding_conditions,
)
from flexgpu.kubelet_plugin.api.kube_api import ApiError
from flexgpu.kubelet_plugin.claims.claim_source import claim_path
from flexgpu.kubelet_plugin.claims.claim_status import ClaimStatusWriter
from flexgpu.kubelet_plugin.claims.early_partitions import EarlyPartitions
from tests.conftest import wait_for
from tests.unit.kubelet_plugin.fake_kube_api import FakeKubeApi
from tests.unit.kubelet_plugin.prepare_support import DYNAMIC_GPU, NODE, ClaimTable, Node

PART = f"gpu-{DYNAMIC_GPU}-mig-1g10gb-3"


def claim_object(name: str, device: str, *, pool: str = NODE, conditions: bool = True) -> Any:
    result: dict[str, Any] = {
        "request": "mig",
        "driver": DRIVER_NAME,
        "pool": pool,
        "device": device,
    }
    if conditions:
        result["bindingConditions"] = [PARTITION_READY_CONDITION]
        result["bindingFailureConditions"] = [PARTITION_FAILED_CONDITION]
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }


class World:
    def __init__(self, tmp_path: Path, claims: list[Any]) -> None:
        self.node = Node(tmp_path, ClaimTable())
        self.node.devices.binding_conditions = True
        self.node.devices.refresh()
        self.api = FakeKubeApi()
        self.api.lists[CLAIMS] = claims
        for claim in claims:
            meta = claim["metadata"]
            self.api.put_object(claim_path("ns", meta["name"]), copy.deepcopy(claim))
        self.writer = ClaimStatusWriter(self.api, NODE)
        self.now = 0.0
        self.republished = 0
        self.watch = BindingWatch(
            self.api,  # type: ignore[arg-type]
            NODE,
            early=EarlyPartitions(self.node.preparer),
            status=self.writer,
            devices=self.node.devices,
            republish=self._republish,
            failure_s=60,
            clock=lambda: self.now,
        )
        self.watch.ensure_watch()
        assert self.watch.claims.wait_synced(5)

    def _republish(self) -> None:
        self.republished += 1

    def pass_once(self) -> None:
        self.watch.process()
        self.writer.flush()

    def entries(self, name: str) -> list[dict[str, Any]]:
        status = self.api.objects[claim_path("ns", name)].get("status") or {}
        entries: list[dict[str, Any]] = status.get("devices") or []
        return entries

    def stop(self) -> None:
        self.watch.claims.stop()


def test_only_claims_waiting_on_this_node_are_kept(tmp_path: Path) -> None:
    world = World(
        tmp_path,
        [
            claim_object("here", PART),
            claim_object("elsewhere", PART, pool="node-b"),
            claim_object("no-conditions", PART, conditions=False),
        ],
    )
    try:
        assert [o["metadata"]["name"] for o in world.watch.claims.items()] == ["here"]
    finally:
        world.stop()


def test_a_waiting_claim_gets_its_partition_and_partition_ready(tmp_path: Path) -> None:
    world = World(tmp_path, [claim_object("c", PART)])
    try:
        world.pass_once()
        (made,) = world.node.backend.list_mig_devices(DYNAMIC_GPU)
        (entry,) = world.entries("c")
        assert entry["device"] == PART and entry["data"] == {"uuid": made.uuid}
        assert [(c["type"], c["status"]) for c in entry["conditions"]] == [
            (PARTITION_READY_CONDITION, "True")
        ]
    finally:
        world.stop()


def test_a_failure_reports_partition_failed_and_taints_the_gpu_until_the_cool_down(
    tmp_path: Path,
) -> None:
    world = World(tmp_path, [claim_object("c", PART)])
    try:
        world.node.backend.faults.fail_next("create_mig_device")
        world.pass_once()

        assert world.node.backend.list_mig_devices(DYNAMIC_GPU) == []
        (entry,) = world.entries("c")
        (condition,) = entry["conditions"]
        assert (condition["type"], condition["reason"]) == (
            PARTITION_FAILED_CONDITION,
            "CreateFailed",
        )
        assert f"gpu-{DYNAMIC_GPU}" in condition["message"]
        assert world.republished == 1
        tainted = _partitions_tainted(world)
        assert tainted and all(tainted.values())
        # Decided: the next pass leaves the claim to the scheduler, and makes nothing.
        world.pass_once()
        assert world.node.backend.list_mig_devices(DYNAMIC_GPU) == []

        world.now = 61
        world.pass_once()
        assert world.republished == 2
        assert not any(_partitions_tainted(world).values())
    finally:
        world.stop()


def _partitions_tainted(world: World) -> dict[str, bool]:
    prefix = f"gpu-{DYNAMIC_GPU}-mig-"
    return {
        d["name"]: any(t["key"] == PARTITION_FAILED_TAINT for t in d.get("taints", []))
        for d in world.node.devices.slice_devices()
        if d["name"].startswith(prefix)
    }


def test_a_claim_deallocated_before_prepare_has_its_partition_destroyed(tmp_path: Path) -> None:
    world = World(tmp_path, [claim_object("c", PART)])
    try:
        world.pass_once()
        assert len(world.node.backend.list_mig_devices(DYNAMIC_GPU)) == 1
        deallocated = claim_object("c", PART)
        deallocated["status"] = {}
        (events,) = [world.api.watches.get(timeout=5)]
        events.put(("MODIFIED", deallocated))
        wait_for(lambda: not world.watch.claims.items(), timeout_s=5, what="claim dropped")

        world.pass_once()

        assert world.node.backend.list_mig_devices(DYNAMIC_GPU) == []
        assert world.node.store.get("uid-c") is None
    finally:
        world.stop()


def test_partitions_carry_binding_conditions_only_when_on(tmp_path: Path) -> None:
    node = Node(tmp_path, ClaimTable())
    off = {d["name"]: d for d in node.devices.slice_devices()}
    node.devices.binding_conditions = True
    node.devices.refresh()
    on = {d["name"]: d for d in node.devices.slice_devices()}

    assert not any("bindingConditions" in d for d in off.values())
    assert on[PART]["bindingConditions"] == [PARTITION_READY_CONDITION]
    assert on[PART]["bindingFailureConditions"] == [PARTITION_FAILED_CONDITION]
    assert on[PART]["bindsToNode"] is True
    # The whole GPUs are not made on demand: nothing to wait for.
    assert "bindingConditions" not in on[f"gpu-{DYNAMIC_GPU}"]
    assert "bindingConditions" not in on["gpu-0"]


def test_without_taints_a_failed_gpus_partitions_are_withdrawn(tmp_path: Path) -> None:
    node = Node(tmp_path, ClaimTable())
    node.devices.health_taints = False
    node.devices.set_partition_failures({DYNAMIC_GPU: "injected"})
    node.devices.refresh()
    names = {d["name"] for d in node.devices.slice_devices()}
    assert PART not in names and f"gpu-{DYNAMIC_GPU}" in names


def test_the_probe_reads_whether_the_server_kept_the_fields() -> None:
    api = FakeKubeApi()
    assert server_keeps_binding_conditions(api, NODE)  # type: ignore[arg-type]
    assert ("POST", "/apis/resource.k8s.io/v1/resourceslices") in api.sent

    class Dropping(FakeKubeApi):
        def request(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
            body = copy.deepcopy(kw.get("body"))
            if body:
                for device in body["spec"]["devices"]:
                    device.pop("bindingConditions")
            return super().request(method, path, **{**kw, "body": body})

    assert not server_keeps_binding_conditions(Dropping(), NODE)  # type: ignore[arg-type]
    refusing = FakeKubeApi()
    refusing.fail_next.append(ApiError(403, "Forbidden", "no"))
    assert not server_keeps_binding_conditions(refusing, NODE)  # type: ignore[arg-type]


def test_claims_are_watched_only_while_the_node_has_on_demand_mig(tmp_path: Path) -> None:
    """Every node watching every claim would cost the API server for nothing."""
    world = World(tmp_path, [claim_object("c", PART)])
    try:
        world.node.devices.set_modes({})  # GPU 1 whole again: no on-demand MIG left
        world.watch.ensure_watch()
        lists = world.api.count("GET")
        world.watch.process()
        assert world.node.backend.list_mig_devices(DYNAMIC_GPU) == []
        assert world.api.count("GET") == lists
    finally:
        world.stop()
