"""A power loss tears a claim record while its CDI spec survives in a persistent CDI folder
(``cdiDir`` is a chart value): the spec names what the reboot took away (a MIG instance, an
MPS daemon), so start-up never rebuilds the record from it, and the kubelet's next prepare of
the claim gets fresh state, never the old spec."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

from flexgpu.kubelet_plugin.claims.spec_facts import read_boot_time
from flexgpu.kubelet_plugin.claims.startup_reconcile import ReconcileReport, reconcile_at_start
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef
from tests.unit.kubelet_plugin.prepare_support import (
    BOOT_A,
    BOOT_B,
    DYNAMIC_GPU,
    ClaimTable,
    Node,
    device,
)

MIG_DEVICE = f"gpu-{DYNAMIC_GPU}-mig-3g40gb-4"


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path, ClaimTable())


def _restart(node: Node, boot_id: str) -> tuple[ReconcileReport, list[tuple[str, str]]]:
    node.restart(boot_id=boot_id)
    events: list[tuple[str, str]] = []
    with node.lock:
        report = reconcile_at_start(
            node.preparer, node.store, node.table, lambda r, m: events.append((r, m))
        )
    return report, events


def _prepared_mig_claim(node: Node) -> tuple[ClaimRef, Path, str]:
    ref = node.table.add("mig", device(MIG_DEVICE))
    assert node.preparer.prepare([ref])[ref.uid].error == ""
    (instance,) = node.backend.list_mig_devices(DYNAMIC_GPU)
    assert instance.uuid
    return ref, node.preparer.spec_path(ref.uid), instance.uuid


def _power_loss(node: Node, ref: ClaimRef) -> None:
    """The record is torn (empty), and the reboot takes the MIG instance and MPS daemons."""
    node.store.record_path(ref.uid).write_bytes(b"")
    for gpu in node.backend.list_mig_devices(DYNAMIC_GPU):
        node.backend.destroy_mig_device(DYNAMIC_GPU, gpu.gpu_instance_id)
    assert node.backend.list_mig_devices(DYNAMIC_GPU) == []


def _spec_env(spec: Path) -> dict[str, str]:
    document: dict[str, Any] = json.loads(spec.read_text())
    cdi, _metadata = document["devices"]
    return dict(item.split("=", 1) for item in cdi["containerEdits"]["env"])


def _without_boot_id(spec: Path) -> None:
    """As an earlier release wrote the spec: no boot id in the device's variable."""
    text = re.sub(r";boot=[0-9a-f-]+", "", spec.read_text())
    assert "boot=" not in text
    spec.write_text(text)


@pytest.mark.parametrize("how", ["boot-id", "older-than-the-boot"])
def test_torn_record_and_a_spec_of_an_earlier_boot_give_fresh_state(node: Node, how: str) -> None:
    ref, spec, old_uuid = _prepared_mig_claim(node)
    assert f";boot={BOOT_A}" in next(iter(_spec_env(spec).values()))
    _power_loss(node, ref)
    if how == "older-than-the-boot":
        _without_boot_id(spec)
        boot_time = read_boot_time()
        assert boot_time is not None
        os.utime(spec, (boot_time - 3600, boot_time - 3600))

    report, events = _restart(node, BOOT_B)

    # Nothing rebuilt from the old spec, which is gone.
    assert report.rebuilt == []
    assert report.earlier_boot_specs == [spec.name]
    assert node.store.get(ref.uid) is None
    assert not spec.exists()
    ((reason, message),) = events
    assert reason == "CheckpointCorrupt"
    assert f"1 CDI spec(s) of an earlier boot ({spec.name}) were not used" in message
    # The kubelet prepares the claim again: a new partition, a spec of this boot naming it.
    (result,) = node.preparer.prepare([ref]).values()
    assert result.error == ""
    (instance,) = node.backend.list_mig_devices(DYNAMIC_GPU)
    (own,) = _spec_env(spec).values()
    assert f"uuid={instance.uuid};" in own and own.endswith(f";boot={BOOT_B}")
    assert old_uuid not in spec.read_text() or old_uuid == instance.uuid
    record = node.store.get(ref.uid)
    assert record is not None and len(record.created.mig_instances) == 1


def test_torn_record_and_a_spec_of_this_boot_still_rebuild(node: Node) -> None:
    """The control: without a reboot (or with a spec of an earlier release written in this
    boot) the spec is this boot's and the record is rebuilt, the partition kept."""
    ref, spec, uuid = _prepared_mig_claim(node)
    node.store.record_path(ref.uid).write_bytes(b"")
    _without_boot_id(spec)
    now = time.time()
    os.utime(spec, (now, now))

    report, _ = _restart(node, BOOT_A)

    assert report.rebuilt == ["ns/mig"] and report.earlier_boot_specs == []
    assert spec.exists()
    assert [m.uuid for m in node.backend.list_mig_devices(DYNAMIC_GPU)] == [uuid]
