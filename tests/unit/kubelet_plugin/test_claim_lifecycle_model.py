"""A model of a claim's life on one node under binding conditions, checked against the plugin
by a stateful property test.

The model plays the scheduler and the kubelet: it allocates on-demand MIG partitions (with
PartitionReady) and shares of two shared GPUs (with TenantReady while a GPU is free, without
once it serves the claim's namespace), sends back claims told TenantTaken or PartitionFailed and
allocates them anew, binds and prepares a claim once its conditions are true, unprepares,
deletes claims before and after binding, restarts the plugin (a new process on the same
disk, hardware and API server), and has the API server refuse writes now and then. The
plugin is the real one: the binding watch (tenant decisions, partitions made before binding),
the preparer, the status writer, start-up reconcile, over the simulated GPUs and an
in-memory API server that refuses what the real one refuses (an allocation change, an entry
of a device not allocated).

After every step the model says what must exist, and the plugin must agree:
- no MIG partition on the GPU that no record owns, and no record of a claim that is gone;
- a shared GPU serves one namespace: its prepared records and the claims told TenantReady;
- once the plugin has had a pass (and any refused write its paced second try), every
  allocated claim that waits has its outcome on the claim: TenantReady/PartitionReady, or
  TenantTaken/PartitionFailed; a prepared claim is Ready;
- every status entry names a device the claim has allocated, and no write was refused but
  the ones the model injected.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from flexgpu.driver.names import (
    DRIVER_NAME,
    PARTITION_FAILED_CONDITION,
    PARTITION_READY_CONDITION,
    TENANT_READY_CONDITION,
    TENANT_TAKEN_CONDITION,
)
from flexgpu.kubelet_plugin.agents.binding_watch import RESEND_FIRST_S, BindingWatch
from flexgpu.kubelet_plugin.api.kube_api import ApiError
from flexgpu.kubelet_plugin.claims.claim_source import ClaimView, claim_path, parse_claim
from flexgpu.kubelet_plugin.claims.claim_status import ClaimStatusWriter
from flexgpu.kubelet_plugin.claims.early_partitions import EarlyPartitions
from flexgpu.kubelet_plugin.claims.startup_reconcile import reconcile_at_start
from flexgpu.kubelet_plugin.claims.tenant_attribute import TenantAttribute
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef
from tests.unit.kubelet_plugin.fake_kube_api import FakeKubeApi
from tests.unit.kubelet_plugin.prepare_support import (
    DYNAMIC_GPU,
    NODE,
    SHARED_GPU,
    ClaimTable,
    Node,
)

SHARED = (SHARED_GPU, SHARED_GPU + 1)
NAMESPACES = ("team-a", "team-b")
FAILURE = {
    TENANT_READY_CONDITION: TENANT_TAKEN_CONDITION,
    PARTITION_READY_CONDITION: PARTITION_FAILED_CONDITION,
}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ApiClaims:
    """The binding watch's view of the claims, read straight from the in-memory API server
    (the watch's own list-and-watch has tests of its own): the model decides when the
    plugin looks."""

    def __init__(self, api: FakeKubeApi, keep: Any) -> None:
        self._api = api
        self._keep = keep
        self.synced = True

    def items(self) -> list[dict[str, Any]]:
        return [
            o
            for path, o in sorted(self._api.objects.items())
            if "/resourceclaims/" in path and self._keep(o)
        ]

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def wait_synced(self, timeout_s: float) -> bool:
        return True


class DirectBindingWatch(BindingWatch):
    def __init__(self, api: FakeKubeApi, **kwargs: Any) -> None:
        self._model_api = api
        super().__init__(api, NODE, **kwargs)  # type: ignore[arg-type]

    def _new_watch(self) -> Any:
        return ApiClaims(self._model_api, self.waits_here)


@dataclass
class Claim:
    name: str
    namespace: str
    kind: str  # "mig" or "share"
    device: str = ""
    conditions: tuple[str, ...] = ()
    prepared: bool = False
    # The API server refused prepare's status write (the model asked it to): a refused
    # write is given up once built anew from a fresh read, so Ready may be missing.
    ready_refused: bool = False
    allocated_at: int = 0
    generation: int = 0  # allocations so far, for share IDs
    history: list[str] = field(default_factory=list)

    @property
    def uid(self) -> str:
        return f"uid-{self.name}"

    @property
    def share_id(self) -> str | None:
        return f"s-{self.name}-{self.generation}" if self.kind == "share" else None

    @property
    def path(self) -> str:
        return claim_path(self.namespace, self.name)


class ClaimLifecycle(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="lifecycle-"))
        self.table = ClaimTable()
        self.node = Node(self.tmp, self.table, shared=frozenset(SHARED))
        self.api = FakeKubeApi()
        self.clock = Clock()
        self.claims: dict[str, Claim] = {}
        self.serial = 0
        self.ticks = 0
        self.injected = 0  # refusals the model asked the API server for
        self.refused_before = 0  # refusals counted by earlier plugin processes
        self._start_plugin()

    def teardown(self) -> None:
        shutil.rmtree(getattr(self, "tmp", "/nonexistent"), ignore_errors=True)

    # -- the plugin process ---------------------------------------------------------------
    def _start_plugin(self) -> None:
        node = self.node
        node.devices.binding_conditions = True
        node.devices.publish_tenants = True
        self.writer = ClaimStatusWriter(self.api, NODE, clock=self.clock)  # type: ignore[arg-type]
        node.preparer._status = self.writer
        self.attribute = TenantAttribute(node.preparer.load_checkpoint, node.devices, lambda: None)
        self.watch = DirectBindingWatch(
            self.api,
            early=EarlyPartitions(node.preparer),
            status=self.writer,
            devices=node.devices,
            republish=lambda: None,
            failure_s=60,
            # Read anew on each call: the records change under the watch.
            records=lambda: node.preparer.load_checkpoint().claims.values(),  # noqa: PLW0108
            tenants_changed=self.attribute.update,
            clock=self.clock,
        )
        self.attribute.held = self.watch.tenants.holders
        self.attribute.update()
        node.devices.refresh()

    @rule()
    def restart_plugin(self) -> None:
        """SIGKILL and start again: only the disk, the GPUs and the API server remain."""
        self.refused_before += self.writer.refused
        self.node.restart()
        with self.node.lock:
            reconcile_at_start(self.node.preparer, self.node.store, self.table)
        self._start_plugin()

    @rule()
    def plugin_pass(self) -> None:
        self.watch.ensure_watch()
        self.watch.process()
        self.writer.flush()
        self.attribute.update()
        self.node.devices.refresh()

    @rule()
    def time_passes(self) -> None:
        self.clock.now += RESEND_FIRST_S * 2

    @rule()
    def api_refuses_the_next_write(self) -> None:
        refused = ApiError(422, "Invalid", "status.devices[0]: refused by the model")
        # As written, and again as built from a fresh read: the write is given up.
        self.api.fail_writes = [refused, refused]
        self.injected += 1

    # -- the scheduler ----------------------------------------------------------------------
    def _free_partition(self) -> str | None:
        used = {c.device for c in self.claims.values() if c.kind == "mig" and c.device}
        names = [
            d["name"]
            for d in self.node.devices.slice_devices()
            # 1g.10gb placements never overlap one another (1g.10gb+me ones are left out).
            if re.fullmatch(rf"gpu-{DYNAMIC_GPU}-mig-1g10gb-\d+", d["name"])
            and d["name"] not in used
        ]
        return names[0] if names else None

    def _shared_gpu_for(self, namespace: str, avoid: str) -> tuple[str, bool] | None:
        """A shared GPU the scheduler may allocate for the namespace (its published tenant
        is free or the namespace), and whether it carries the tenant conditions (free)."""
        for device in self.node.devices.slice_devices():
            index = self.node.devices.shared_gpu_index(device["name"])
            if index is None or device["name"] == avoid:
                continue
            tenant = device["attributes"].get("tenant", {}).get("string", "")
            if tenant in ("", namespace):
                return device["name"], TENANT_READY_CONDITION in device.get("bindingConditions", [])
        return None

    def _allocate(self, claim: Claim, avoid: str = "") -> bool:
        if claim.kind == "mig":
            part = self._free_partition()
            if part is None:
                return False
            claim.device, claim.conditions = part, (PARTITION_READY_CONDITION,)
        else:
            found = self._shared_gpu_for(claim.namespace, avoid)
            if found is None:
                return False
            claim.device = found[0]
            claim.conditions = (TENANT_READY_CONDITION,) if found[1] else ()
        claim.generation += 1
        self.ticks += 1
        claim.allocated_at = self.ticks
        claim.history.append(f"allocated {claim.device} {claim.conditions}")
        result: dict[str, Any] = {
            "request": "gpu",
            "driver": DRIVER_NAME,
            "pool": NODE,
            "device": claim.device,
        }
        if claim.share_id:
            result["shareID"] = claim.share_id
            result["consumedCapacity"] = {"memory": "8Gi"}
        if claim.conditions:
            result["bindingConditions"] = list(claim.conditions)
            result["bindingFailureConditions"] = [FAILURE[c] for c in claim.conditions]
        stamp = f"2026-12-07T10:{claim.allocated_at // 60:02d}:{claim.allocated_at % 60:02d}Z"
        obj = {
            "metadata": {"name": claim.name, "namespace": claim.namespace, "uid": claim.uid},
            "status": {
                "allocation": {"devices": {"results": [result]}, "allocationTimestamp": stamp}
            },
        }
        self.api.put_object(claim.path, obj)
        return True

    @rule(kind=st.sampled_from(["mig", "share"]), namespace=st.sampled_from(NAMESPACES))
    def a_claim_is_allocated(self, kind: str, namespace: str) -> None:
        self.serial += 1
        claim = Claim(f"c{self.serial}", namespace, kind)
        if self._allocate(claim):
            self.claims[claim.name] = claim

    def _true(self, claim: Claim) -> set[str]:
        stored = self.api.objects.get(claim.path) or {}
        return {
            c["type"]
            for e in (stored.get("status") or {}).get("devices") or []
            if e.get("device") == claim.device
            for c in e.get("conditions") or []
            if c.get("status") == "True"
        }

    @precondition(lambda self: any(not c.prepared for c in self.claims.values()))
    @rule(data=st.data())
    def the_scheduler_reads_the_outcomes(self, data: st.DataObject) -> None:
        """A claim told TenantTaken or PartitionFailed loses its allocation (the server
        drops status.devices with it) and is allocated anew elsewhere, if anywhere."""
        for claim in sorted(self.claims.values(), key=lambda c: c.name):
            if claim.prepared:
                continue
            failed = {FAILURE[c] for c in claim.conditions} & self._true(claim)
            if not failed:
                continue
            claim.history.append(f"sent back ({', '.join(sorted(failed))})")
            before = claim.device
            if not self._allocate(claim, avoid=before):
                self._delete(claim)

    @precondition(lambda self: any(not c.prepared for c in self.claims.values()))
    @rule(data=st.data())
    def a_pod_is_bound_and_prepared(self, data: st.DataObject) -> None:
        ready = [
            c for c in self.claims.values() if not c.prepared and set(c.conditions) <= self._true(c)
        ]
        if not ready:
            return
        claim = data.draw(st.sampled_from(sorted(ready, key=lambda c: c.name)))
        view = self._view(claim)
        self.table.views[(claim.namespace, claim.name)] = view
        claim.ready_refused = bool(self.api.fail_writes)
        result = self.node.preparer.prepare([ClaimRef(claim.namespace, claim.name, claim.uid)])
        assert result[claim.uid].error == "", (claim.history, result[claim.uid].error)
        claim.prepared = True
        claim.history.append("prepared")
        self.attribute.update()
        self.writer.flush()

    def _view(self, claim: Claim) -> ClaimView:
        return parse_claim(self.api.objects[claim.path])

    @precondition(lambda self: bool(self.claims))
    @rule(data=st.data())
    def a_claim_is_deleted(self, data: st.DataObject) -> None:
        """Its pod ended (the kubelet unprepares first) or went before it was bound."""
        claim = data.draw(st.sampled_from(sorted(self.claims.values(), key=lambda c: c.name)))
        if claim.prepared:
            ref = ClaimRef(claim.namespace, claim.name, claim.uid)
            assert self.node.preparer.unprepare([ref])[claim.uid].error == ""
            self.attribute.update()
            self.writer.flush()
        self._delete(claim)

    def _delete(self, claim: Claim) -> None:
        self.api.objects.pop(claim.path, None)
        self.table.views.pop((claim.namespace, claim.name), None)
        del self.claims[claim.name]

    # -- what must hold -----------------------------------------------------------------------
    @invariant()
    def no_partition_without_a_record(self) -> None:
        if not hasattr(self, "node"):
            return
        records = self.node.preparer.load_checkpoint().claims.values()
        owned = {
            (m.parent_index, m.placement_start) for r in records for m in r.created.mig_instances
        }
        made = {
            (DYNAMIC_GPU, m.placement.start)
            for m in self.node.backend.list_mig_devices(DYNAMIC_GPU)
        }
        assert made <= owned, f"partitions no record owns: {made - owned}"

    @invariant()
    def no_record_of_a_claim_that_is_gone(self) -> None:
        if not hasattr(self, "node"):
            return
        live = {c.uid for c in self.claims.values()}
        for record in self.node.preparer.load_checkpoint().claims.values():
            if record.early is None:
                assert record.uid in live, f"a prepared record outlived its claim: {record.name}"

    @invariant()
    def a_shared_gpu_serves_one_namespace(self) -> None:
        if not hasattr(self, "node"):
            return
        held: dict[str, set[str]] = {}
        for record in self.node.preparer.load_checkpoint().claims.values():
            for device in record.devices:
                if self.node.devices.shared_gpu_index(device.device_name) is not None:
                    held.setdefault(device.device_name, set()).add(record.namespace)
        for claim in self.claims.values():
            if claim.kind == "share" and TENANT_READY_CONDITION in self._true(claim):
                held.setdefault(claim.device, set()).add(claim.namespace)
        assert all(len(n) == 1 for n in held.values()), held

    @invariant()
    def entries_name_allocated_devices_and_only_injected_writes_are_refused(self) -> None:
        if not hasattr(self, "node"):
            return
        for claim in self.claims.values():
            stored = self.api.objects[claim.path]
            for entry in (stored.get("status") or {}).get("devices") or []:
                assert entry["device"] == claim.device, (claim.history, entry)
        assert self.refused_before + self.writer.refused <= self.injected

    @invariant()
    def after_a_pass_every_waiting_claim_has_its_outcome(self) -> None:
        """Settle: a pass, the resend interval, another pass (a refused write is written
        again once); then each allocated claim's conditions are decided on the claim."""
        if not hasattr(self, "node") or self.api.fail_writes:
            return
        self.plugin_pass()
        self.time_passes()
        self.plugin_pass()
        for claim in self.claims.values():
            true = self._true(claim)
            if claim.prepared and not claim.ready_refused:
                assert "Ready" in true, claim.history
            for condition in claim.conditions:
                decided = {condition, FAILURE[condition]} & true
                assert decided, (claim.name, claim.history, true)
        # A failure condition only where another namespace holds the GPU (tenants), never
        # for a partition on a healthy simulated GPU.
        for claim in self.claims.values():
            assert PARTITION_FAILED_CONDITION not in self._true(claim), claim.history


ClaimLifecycle.TestCase.settings = settings(
    max_examples=20,
    stateful_step_count=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestClaimLifecycle = ClaimLifecycle.TestCase
