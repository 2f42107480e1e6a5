"""Sharing a MIG device through prepare. TimeSlicing is accepted as NVIDIA's DRA driver
accepts it: the containers of the claim share the MIG device the way CUDA shares any device
among processes, and nothing is set on the node (a MIG device has no time-slice interval,
and the parent GPU's interval is not the claim's to change). MPS stays refused for now."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flexgpu.driver.gpu_model import ComputeMode, TimeSliceInterval
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.checkpoint import CheckpointStore
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef
from flexgpu.kubelet_plugin.node_devices import NodeDevices
from flexgpu.kubelet_plugin.prepare_lock import PrepareLock
from flexgpu.kubelet_plugin.preparer import ClaimPreparerImpl
from flexgpu.kubelet_plugin.startup_reconcile import reconcile_at_start
from tests.unit.kubelet_plugin.prepare_support import API, DRIVER, NODE, ClaimTable, device

MIG_DEVICE = "gpu-0-mig-1g10gb-0"


def _claim(claims: ClaimTable, name: str, parameters: dict[str, Any]) -> ClaimRef:
    """A claim holding the MIG device, with one opaque config from the claim."""
    entry = {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": parameters}}
    return claims.add(name, device(MIG_DEVICE), configs=(entry,))


def _preparer(tmp_path: Path, backend: SimulatedBackend, claims: ClaimTable) -> ClaimPreparerImpl:
    return ClaimPreparerImpl(
        node_name=NODE,
        claims=claims,
        devices=NodeDevices(backend, dynamic_mig={0}),
        store=CheckpointStore(tmp_path / "data" / "checkpoint.json"),
        lock=PrepareLock(tmp_path / "data" / "lock"),
        cdi_dir=tmp_path / "cdi",
    )


def _backend(tmp_path: Path) -> SimulatedBackend:
    return SimulatedBackend.from_topology("hgx-h100-8", NODE, state_path=tmp_path / "gpus.json")


def _env(preparer: ClaimPreparerImpl, uid: str) -> dict[str, str]:
    spec = json.loads(preparer.spec_path(uid).read_text())
    return dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])


def test_time_slicing_on_a_mig_device_prepares_sets_nothing_and_survives_a_restart(
    tmp_path: Path,
) -> None:
    backend, claims = _backend(tmp_path), ClaimTable()
    preparer = _preparer(tmp_path, backend, claims)
    sharing = {"strategy": "TimeSlicing"}
    ref = _claim(claims, "ts", {"apiVersion": API, "kind": "MigDeviceConfig", "sharing": sharing})
    assert preparer.prepare([ref])[ref.uid].error == ""
    (created,) = backend.list_mig_devices(0)
    env = _env(preparer, ref.uid)
    (own,) = [v for k, v in env.items() if k.startswith("FLEXGPU_DEV")]
    assert own.startswith(f"uuid={created.uuid};") and "timeSlice" not in own
    assert not any(k.startswith("CUDA_MPS_") for k in env)
    # The parent GPU keeps its own settings: no interval, no MPS, no compute mode change.
    assert backend.time_slice(0) == TimeSliceInterval.DEFAULT
    assert backend.get_compute_mode(0) == ComputeMode.DEFAULT
    assert backend.mps_daemons() == []

    restarted_backend = _backend(tmp_path)
    restarted = _preparer(tmp_path, restarted_backend, claims)
    reconcile_at_start(restarted, CheckpointStore(tmp_path / "data" / "checkpoint.json"), claims)
    assert [m.uuid for m in restarted_backend.list_mig_devices(0)] == [created.uuid]
    assert restarted.prepare([ref])[ref.uid].error == ""  # kubelet asks again: same device
    assert [m.uuid for m in restarted_backend.list_mig_devices(0)] == [created.uuid]

    restarted.unprepare([ref])
    assert restarted_backend.list_mig_devices(0) == []
    assert restarted_backend.time_slice(0) == TimeSliceInterval.DEFAULT


def test_mps_on_a_mig_device_is_refused_at_prepare_and_creates_nothing(tmp_path: Path) -> None:
    backend, claims = _backend(tmp_path), ClaimTable()
    preparer = _preparer(tmp_path, backend, claims)
    sharing = {"strategy": "MPS"}
    ref = _claim(claims, "mps", {"apiVersion": API, "kind": "MigConfig", "sharing": sharing})
    error = preparer.prepare([ref])[ref.uid].error
    assert error == (
        'claim ns/mps: config[0].opaque.parameters.sharing.strategy: "MPS" is not supported '
        "on MIG devices yet; allowed: Exclusive, TimeSlicing"
    )
    assert backend.list_mig_devices(0) == []
    assert backend.mps_daemons() == []
