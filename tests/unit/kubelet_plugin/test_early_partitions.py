"""On-demand MIG partitions made before the pod is bound (binding conditions): every state
transition of early_partitions.py, prepare taking the partitions over, and SIGKILLs between
the steps followed by a restart."""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from flexgpu.driver.claim_results import AllocatedDevice
from flexgpu.driver.names import (
    DRIVER_NAME,
    PARTITION_FAILED_CONDITION,
    PARTITION_READY_CONDITION,
)
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.claims.checkpoint import CheckpointStore
from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimState, EarlyStage
from flexgpu.kubelet_plugin.claims.claim_source import ClaimView, claim_path
from flexgpu.kubelet_plugin.claims.claim_status import ClaimStatusWriter
from flexgpu.kubelet_plugin.claims.early_partitions import EarlyPartitions
from flexgpu.kubelet_plugin.claims.prepare_lock import PrepareLock
from flexgpu.kubelet_plugin.claims.preparer import ClaimPreparerImpl
from flexgpu.kubelet_plugin.claims.startup_reconcile import reconcile_at_start
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef
from tests.unit.kubelet_plugin.fake_kube_api import FakeKubeApi
from tests.unit.kubelet_plugin.prepare_support import (
    DYNAMIC_GPU,
    NODE,
    ClaimTable,
    Node,
    device,
)

PART = f"gpu-{DYNAMIC_GPU}-mig-1g10gb-3"
OTHER = f"gpu-{DYNAMIC_GPU}-mig-2g20gb-0"


def waiting(name: str) -> AllocatedDevice:
    """An allocation result of a partition that carries flexgpu's binding conditions."""
    return device(name, request="mig", binding_conditions=(PARTITION_READY_CONDITION,))


def binding_node(tmp_path: Path) -> Node:
    node = Node(tmp_path, ClaimTable())
    node.devices.binding_conditions = True
    return node


def claim_of(node: Node, ref: ClaimRef) -> ClaimView:
    view = node.table.get(ref.namespace, ref.name)
    assert view is not None
    return view


def instances(node: Node) -> list[Any]:
    return node.backend.list_mig_devices(DYNAMIC_GPU)


def restart(node: Node) -> Any:
    node.restart()
    node.devices.binding_conditions = True
    with node.lock:
        return reconcile_at_start(node.preparer, node.store, node.table)


def test_a_waiting_partition_is_created_recorded_ready_and_reported(tmp_path: Path) -> None:
    node = binding_node(tmp_path)
    ref = node.table.add("c", waiting(PART))

    outcome = EarlyPartitions(node.preparer).create(claim_of(node, ref))

    assert outcome is not None and not outcome.failed_gpus
    (made,) = instances(node)
    record = node.store.get(ref.uid)
    assert record is not None
    assert (record.state, record.early) == (ClaimState.PREPARE_STARTED, EarlyStage.READY)
    assert [m.uuid for m in record.created.mig_instances] == [made.uuid]
    (status,) = outcome.statuses
    assert status.device == PART and status.data == {"uuid": made.uuid}
    assert [(c.type, c.status) for c in status.conditions] == [(PARTITION_READY_CONDITION, "True")]
    # A second pass (the watch fires again) makes nothing more.
    assert EarlyPartitions(node.preparer).create(claim_of(node, ref)) is None
    assert len(instances(node)) == 1


def test_prepare_takes_the_ready_partition_over_without_creating_another(tmp_path: Path) -> None:
    node = binding_node(tmp_path)
    ref = node.table.add("c", waiting(PART))
    EarlyPartitions(node.preparer).create(claim_of(node, ref))
    (made,) = instances(node)
    creations: list[str] = []
    node.backend.faults.fail_next("create_mig_device")  # a second creation would fail
    node.preparer.on_step = lambda step, uid: creations.append(step)

    result = node.preparer.prepare([ref])[ref.uid]

    assert result.error == ""
    assert instances(node) == [made]
    record = node.store.get(ref.uid)
    assert record is not None and record.state == ClaimState.PREPARED and record.early is None
    assert [m.uuid for m in record.created.mig_instances] == [made.uuid]
    assert made.uuid in node.preparer.spec_path(ref.uid).read_text()
    # Unprepare destroys it as it destroys a partition prepare made.
    assert node.preparer.unprepare([ref])[ref.uid].error == ""
    assert instances(node) == []


def test_a_prepared_devices_status_keeps_the_binding_condition_true(tmp_path: Path) -> None:
    """The scheduler checks the condition for every pod that shares the claim, so prepare's
    status write keeps it beside Ready."""
    node = binding_node(tmp_path)
    ref = node.table.add("c", waiting(PART))
    api = FakeKubeApi()
    path = claim_path("ns", "c")
    result = {"request": "mig", "driver": DRIVER_NAME, "pool": NODE, "device": PART}
    api.put_object(
        path,
        {
            "metadata": {"uid": ref.uid, "namespace": "ns", "name": "c"},
            "status": {"allocation": {"devices": {"results": [result]}}},
        },
    )
    writer = ClaimStatusWriter(api, NODE)
    preparer = ClaimPreparerImpl(
        node_name=NODE,
        claims=node.table,
        devices=node.devices,
        store=node.store,
        lock=node.lock,
        cdi_dir=tmp_path / "cdi",
        status=writer,
    )
    EarlyPartitions(preparer).create(claim_of(node, ref))

    assert preparer.prepare([ref])[ref.uid].error == ""
    writer.flush()

    (entry,) = api.objects[path]["status"]["devices"]
    assert {(c["type"], c["status"]) for c in entry["conditions"]} == {
        ("Ready", "True"),
        (PARTITION_READY_CONDITION, "True"),
    }


def test_a_failed_creation_destroys_what_was_made_and_names_gpu_and_error(
    tmp_path: Path,
) -> None:
    node = binding_node(tmp_path)
    ref = node.table.add("two", waiting(PART), waiting(OTHER))

    def fail_second(step: str, uid: str) -> None:
        if step == "early-created":
            node.backend.faults.fail_next("create_mig_device")

    node.preparer.on_step = fail_second
    outcome = EarlyPartitions(node.preparer).create(claim_of(node, ref))

    assert outcome is not None
    assert instances(node) == []  # the first partition was destroyed again
    assert node.store.get(ref.uid) is None
    assert set(outcome.failed_gpus) == {DYNAMIC_GPU}
    for status in outcome.statuses:
        (condition,) = status.conditions
        assert (condition.type, condition.status) == (PARTITION_FAILED_CONDITION, "True")
        assert f"on gpu-{DYNAMIC_GPU} of node {NODE}" in condition.message
        assert "injected failure in create_mig_device" in condition.message
    _parent_left_clean(node)


def _parent_left_clean(node: Node) -> None:
    # Nothing else was created on the parent while it failed.
    assert node.backend.list_mig_devices(DYNAMIC_GPU) == []


def test_a_claim_that_no_longer_waits_has_its_partition_destroyed(tmp_path: Path) -> None:
    node = binding_node(tmp_path)
    early = EarlyPartitions(node.preparer)
    gone = node.table.add("gone", waiting(PART))
    kept = node.table.add("kept", waiting(OTHER))
    early.create(claim_of(node, gone))
    early.create(claim_of(node, kept))

    released = early.sweep({kept.uid: claim_of(node, kept)})

    assert released == [gone.uid]
    assert node.store.get(gone.uid) is None
    assert [m.placement.start for m in instances(node)] == [0]  # the 2g.20gb at 0 stays


def test_a_claim_allocated_anew_loses_its_old_partition(tmp_path: Path) -> None:
    node = binding_node(tmp_path)
    early = EarlyPartitions(node.preparer)
    ref = node.table.add("moved", waiting(PART))
    early.create(claim_of(node, ref))
    moved = node.table.add("moved", waiting(OTHER))  # same UID, another placement

    assert early.sweep({moved.uid: claim_of(node, moved)}) == [moved.uid]
    assert instances(node) == []
    assert early.create(claim_of(node, moved)) is not None
    assert [m.placement.start for m in instances(node)] == [0]


def test_the_sweep_leaves_claims_that_prepare_owns(tmp_path: Path) -> None:
    node = binding_node(tmp_path)
    ref = node.table.add("prepared", waiting(PART))
    assert node.preparer.prepare([ref])[ref.uid].error == ""  # created in prepare

    assert EarlyPartitions(node.preparer).sweep({}) == []
    assert len(instances(node)) == 1


def test_prepare_undoes_an_early_record_for_other_placements(tmp_path: Path) -> None:
    node = binding_node(tmp_path)
    ref = node.table.add("c", waiting(PART))
    EarlyPartitions(node.preparer).create(claim_of(node, ref))
    ref = node.table.add("c", waiting(OTHER))  # allocated anew before the sweep ran

    assert node.preparer.prepare([ref])[ref.uid].error == ""
    assert [m.placement.start for m in instances(node)] == [0]  # the old one is gone


# -- crashes ------------------------------------------------------------------------------


def _killed_creating(node: Node, ref: ClaimRef, step: str) -> None:
    """Runs the early creation in a fresh plugin process that SIGKILLs itself at ``step``."""

    def child() -> None:
        devices = NodeDevices(
            SimulatedBackend.from_topology(
                "hgx-h100-8", NODE, state_path=node.data_dir / "simulated-gpus.json"
            ),
            dynamic_mig={DYNAMIC_GPU},
            binding_conditions=True,
        )
        preparer = ClaimPreparerImpl(
            node_name=NODE,
            claims=node.table,
            devices=devices,
            store=CheckpointStore(node.data_dir / "checkpoint.json", node.root / "boot_id"),
            lock=PrepareLock(node.data_dir / "prepare.lock", timeout=20),
            cdi_dir=node.root / "cdi",
            crash_at=step,
        )
        view = node.table.get(ref.namespace, ref.name)
        assert view is not None
        EarlyPartitions(preparer).create(view)
        os._exit(3)  # the step was never reached

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(30)
    assert process.exitcode == -signal.SIGKILL, f"not killed at {step}"


@pytest.mark.parametrize("step", ["early-recorded", "early-created"])
def test_sigkill_before_ready_is_rolled_back_at_restart(tmp_path: Path, step: str) -> None:
    node = binding_node(tmp_path)
    ref = node.table.add("half", waiting(PART))
    _killed_creating(node, ref, step)
    node.restart()
    record = node.store.get(ref.uid)
    assert record is not None and record.early == EarlyStage.CREATING

    report = restart(node)

    assert report.rolled_back == ["ns/half"]
    assert instances(node) == [] and node.store.get(ref.uid) is None
    # The watch tries again (or prepare creates it).
    assert EarlyPartitions(node.preparer).create(claim_of(node, ref)) is not None
    assert len(instances(node)) == 1


def test_sigkill_after_ready_keeps_the_partition_for_prepare(tmp_path: Path) -> None:
    node = binding_node(tmp_path)
    ref = node.table.add("ready", waiting(PART))
    _killed_creating(node, ref, "early-ready")

    report = restart(node)

    assert report.kept == ["ns/ready"]
    (made,) = instances(node)
    assert node.preparer.prepare([ref])[ref.uid].error == ""
    assert instances(node) == [made]


def test_a_ready_partition_is_rolled_back_when_binding_conditions_are_now_off(
    tmp_path: Path,
) -> None:
    """Nothing would sweep it: the claim may never be prepared here."""
    node = binding_node(tmp_path)
    ref = node.table.add("ready", waiting(PART))
    EarlyPartitions(node.preparer).create(claim_of(node, ref))
    node.restart()  # binding conditions off
    with node.lock:
        report = reconcile_at_start(node.preparer, node.store, node.table)

    assert report.rolled_back == ["ns/ready"]
    assert instances(node) == []


def test_an_older_plugin_reads_an_early_record_as_half_prepared(tmp_path: Path) -> None:
    """A record written before binding conditions existed has no ``early`` field, and an
    early record keeps state PrepareStarted, so a plugin without this feature rolls it back."""
    node = binding_node(tmp_path)
    ref = node.table.add("c", waiting(PART))
    EarlyPartitions(node.preparer).create(claim_of(node, ref))
    text = node.store.record_path(ref.uid).read_text()
    assert '"state":"PrepareStarted"' in text.replace(" ", "")
    assert node.preparer.prepare([ref])[ref.uid].error == ""
    assert '"early"' not in node.store.record_path(ref.uid).read_text()


def test_a_device_still_prepared_for_another_claim_waits_instead_of_failing(
    tmp_path: Path,
) -> None:
    """The scheduler frees a device when its claim is deleted, before the kubelet has
    unprepared it: the next claim's partition waits for that unprepare."""
    node = binding_node(tmp_path)
    old = node.table.add("old", waiting(PART))
    assert node.preparer.prepare([old])[old.uid].error == ""
    new = node.table.add("new", waiting(PART))
    early = EarlyPartitions(node.preparer)

    outcome = early.create(claim_of(node, new))

    assert outcome is not None and outcome.busy and not outcome.failed
    assert node.store.get(new.uid) is None and len(instances(node)) == 1
    assert node.preparer.unprepare([old])[old.uid].error == ""
    outcome = early.create(claim_of(node, new))
    assert outcome is not None and not outcome.busy and not outcome.failed
    assert len(instances(node)) == 1
