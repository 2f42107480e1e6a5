"""Prepare applies defaultPerDevicePinnedMemoryLimit as NVIDIA does: "0" is the claim's first
device (by UUID), whatever the GPU's index on the node; a key that matches no device of the
claim fails the claim with the devices listed instead of being dropped."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flexgpu.driver.claim_results import AllocatedDevice
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.claims.checkpoint import CheckpointStore
from flexgpu.kubelet_plugin.claims.claim_source import ClaimView
from flexgpu.kubelet_plugin.claims.prepare_lock import PrepareLock
from flexgpu.kubelet_plugin.claims.preparer import ClaimPreparerImpl
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef

NODE = "node-a"
DRIVER = "gpu.flexgpu.dev"
API = "gpu.flexgpu.dev/v1alpha1"


class Claims:
    def __init__(self) -> None:
        self.views: dict[str, ClaimView] = {}

    def add(self, name: str, device: str, mps: dict[str, Any]) -> ClaimRef:
        parameters = {"apiVersion": API, "kind": "GpuConfig", "sharing": mps}
        configs = ({"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": parameters}},)
        allocated = (AllocatedDevice("gpu", DRIVER, NODE, device),)
        self.views[name] = ClaimView(f"uid-{name}", "ns", name, True, allocated, configs)
        return ClaimRef("ns", name, f"uid-{name}")

    def get(self, namespace: str, name: str) -> ClaimView | None:
        return self.views.get(name)


@pytest.fixture
def backend(tmp_path: Path) -> SimulatedBackend:
    return SimulatedBackend.from_topology("l4-2-pcie", NODE, state_path=tmp_path / "gpus.json")


@pytest.fixture
def claims() -> Claims:
    return Claims()


@pytest.fixture
def preparer(tmp_path: Path, backend: SimulatedBackend, claims: Claims) -> ClaimPreparerImpl:
    return ClaimPreparerImpl(
        node_name=NODE,
        claims=claims,
        devices=NodeDevices(backend, shared=set()),
        store=CheckpointStore(tmp_path / "data" / "checkpoint.json"),
        lock=PrepareLock(tmp_path / "data" / "lock"),
        cdi_dir=tmp_path / "cdi",
    )


def env(preparer: ClaimPreparerImpl, uid: str) -> dict[str, str]:
    spec = json.loads(preparer.spec_path(uid).read_text())
    return dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])


def mps(**config: Any) -> dict[str, Any]:
    return {"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "10Gi", **config}}


def test_index_zero_is_the_claims_device_even_on_the_nodes_second_gpu(
    preparer: ClaimPreparerImpl, claims: Claims
) -> None:
    ref = claims.add("m", "gpu-1", mps(defaultPerDevicePinnedMemoryLimit={"0": "12Gi"}))
    assert preparer.prepare([ref])[ref.uid].error == ""
    assert env(preparer, ref.uid)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=12288M"


def test_the_devices_uuid_is_a_key_too(
    preparer: ClaimPreparerImpl, backend: SimulatedBackend, claims: Claims
) -> None:
    uuid = backend.list_gpus()[1].uuid
    ref = claims.add("m", "gpu-1", mps(defaultPerDevicePinnedMemoryLimit={uuid: "6Gi"}))
    assert preparer.prepare([ref])[ref.uid].error == ""
    assert env(preparer, ref.uid)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=6144M"


def test_a_key_matching_no_device_of_the_claim_fails_it_and_starts_nothing(
    preparer: ClaimPreparerImpl, backend: SimulatedBackend, claims: Claims
) -> None:
    # "1" is the node's index of gpu-1, but the claim has one device: index 0 only.
    ref = claims.add("m", "gpu-1", mps(defaultPerDevicePinnedMemoryLimit={"1": "12Gi"}))
    error = preparer.prepare([ref])[ref.uid].error
    uuid = backend.list_gpus()[1].uuid
    assert error.startswith(
        'claim ns/m: sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit: key "1" matches no '
        f"device of the claim; allowed: an index from 0 to 0, or the name or UUID of a device "
        f"the config applies to (by UUID order: 0 = gpu-1 ({uuid}))"
    )
    assert backend.mps_daemons() == []
    assert preparer.load_checkpoint().claims == {}


def test_multi_user_is_refused_and_starts_nothing(
    preparer: ClaimPreparerImpl, backend: SimulatedBackend, claims: Claims
) -> None:
    """No MPS daemon flexgpu starts has a multi-user mode (docs/migrating.md): true is
    refused, with why and what to do; false changes nothing."""
    ref = claims.add("m", "gpu-0", mps(multiUser=True))
    error = preparer.prepare([ref])[ref.uid].error
    assert error.startswith(
        "claim ns/m: config[0].opaque.parameters.sharing.mpsConfig.multiUser: true is not "
        "supported: NVIDIA's DRA driver has no such setting"
    )
    assert error.endswith(
        "allowed: false, or leave it out and run the claim's containers as one user"
    )
    assert backend.mps_daemons() == []
    ref = claims.add("f", "gpu-0", mps(multiUser=False))
    assert preparer.prepare([ref])[ref.uid].error == ""
    assert [d.gpu_index for d in backend.mps_daemons()] == [0]
