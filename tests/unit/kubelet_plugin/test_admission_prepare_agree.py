"""Admission and prepare give the same verdict, with the same text, for the same config.

Each row is one opaque config on a request of one of our DeviceClasses. It goes through the
admission webhook's check of a ResourceClaim (``controller.admission``) and through the kubelet
plugin's prepare of a claim allocated a device of that class (``ClaimPreparerImpl``). A config
admission lets through must prepare, and one prepare refuses must already be refused at
creation, with the same message (its path starts at ``spec.devices.config`` in the object and
at ``config`` in the allocation result; the rest is identical).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flexgpu.controller.admission import validate_resource_claim
from flexgpu.driver.claim_results import AllocatedDevice, parse_consumed_capacity
from flexgpu.driver.names import (
    DRIVER_NAME,
    GPU_DEVICE_CLASS,
    MIG_DEVICE_CLASS,
    SHARED_GPU_DEVICE_CLASS,
)
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.claims.checkpoint import CheckpointStore
from flexgpu.kubelet_plugin.claims.claim_source import ClaimView
from flexgpu.kubelet_plugin.claims.prepare_lock import PrepareLock
from flexgpu.kubelet_plugin.claims.preparer import ClaimPreparerImpl
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef

NODE = "node-a"
API = "gpu.flexgpu.dev/v1alpha1"
# A device of each class on the simulated node: GPU 0 is carved up on demand, GPU 1 is
# shared, GPU 2 is whole.
DEVICE_OF_CLASS = {
    GPU_DEVICE_CLASS: AllocatedDevice("gpu", DRIVER_NAME, NODE, "gpu-2"),
    MIG_DEVICE_CLASS: AllocatedDevice("gpu", DRIVER_NAME, NODE, "gpu-0-mig-1g10gb-0"),
    SHARED_GPU_DEVICE_CLASS: AllocatedDevice(
        "gpu",
        DRIVER_NAME,
        NODE,
        "gpu-1",
        share_id="s1",
        consumed_capacity=parse_consumed_capacity({"memory": "8Gi", "compute": "0"}),
    ),
}


def mig(sharing: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "MigConfig", **({"sharing": sharing} if sharing else {})}


def gpu(sharing: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "GpuConfig", **({"sharing": sharing} if sharing else {})}


# (device class, opaque parameters, refused?)
TABLE: list[tuple[str, object, bool]] = [
    (MIG_DEVICE_CLASS, mig(), False),
    (MIG_DEVICE_CLASS, mig({"strategy": "Exclusive"}), False),
    (MIG_DEVICE_CLASS, mig({"strategy": "TimeSlicing"}), False),
    (MIG_DEVICE_CLASS, {**mig({"strategy": "TimeSlicing"}), "kind": "MigDeviceConfig"}, False),
    # A MIG device has no time-slice interval to set: the block is not part of its config.
    (
        MIG_DEVICE_CLASS,
        mig({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
        True,
    ),
    # MPS on a MIG device: a daemon of the claim's own, its limits keyed as NVIDIA keys them.
    (MIG_DEVICE_CLASS, mig({"strategy": "MPS"}), False),
    (MIG_DEVICE_CLASS, {**mig({"strategy": "MPS"}), "kind": "MigDeviceConfig"}, False),
    (
        MIG_DEVICE_CLASS,
        mig({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}),
        False,
    ),
    (
        MIG_DEVICE_CLASS,
        mig(
            {
                "strategy": "MPS",
                "mpsConfig": {
                    "defaultPinnedDeviceMemoryLimit": "2Gi",
                    "defaultPerDevicePinnedMemoryLimit": {"0": "3Gi"},
                },
            }
        ),
        False,
    ),
    (
        MIG_DEVICE_CLASS,
        mig({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}),
        True,
    ),
    (MIG_DEVICE_CLASS, mig({"strategy": "MPS", "timeSlicingConfig": {}}), True),
    (MIG_DEVICE_CLASS, mig({"strategy": "MPS", "mpsConfig": {"multiUser": True}}), True),
    (MIG_DEVICE_CLASS, mig({"strategy": "MPS", "mpsConfig": {"multiUser": False}}), False),
    (MIG_DEVICE_CLASS, mig({"strategy": "Shared"}), True),
    (MIG_DEVICE_CLASS, mig({"strategy": "Exclusive", "extra": 1}), True),
    (GPU_DEVICE_CLASS, gpu(), False),
    (
        GPU_DEVICE_CLASS,
        gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
        False,
    ),
    (
        GPU_DEVICE_CLASS,
        gpu({"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 20}}),
        False,
    ),
    (GPU_DEVICE_CLASS, gpu({"strategy": "MPS", "timeSlicingConfig": {}}), True),
    (GPU_DEVICE_CLASS, gpu({"strategy": "MPS", "mpsConfig": {"multiUser": True}}), True),
    (GPU_DEVICE_CLASS, gpu({"strategy": "MPS", "mpsConfig": {"multiUser": False}}), False),
    (SHARED_GPU_DEVICE_CLASS, gpu({"strategy": "MPS", "mpsConfig": {"multiUser": True}}), True),
    (
        GPU_DEVICE_CLASS,
        gpu({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Soon"}}),
        True,
    ),
    (GPU_DEVICE_CLASS, {"apiVersion": "v9", "kind": "GpuConfig"}, True),
    (GPU_DEVICE_CLASS, [1, 2], True),
    (SHARED_GPU_DEVICE_CLASS, gpu(), False),
    (SHARED_GPU_DEVICE_CLASS, gpu({"strategy": "MPS"}), False),
    (SHARED_GPU_DEVICE_CLASS, gpu({"strategy": "TimeSlicing"}), True),
    (SHARED_GPU_DEVICE_CLASS, mig(), True),
    # A burstable fraction: its own block, only on a shared GPU.
    (SHARED_GPU_DEVICE_CLASS, {**gpu(), "share": {"computeLimit": 70}}, False),
    (SHARED_GPU_DEVICE_CLASS, {**gpu({"strategy": "MPS"}), "share": {"computeLimit": 1}}, False),
    (SHARED_GPU_DEVICE_CLASS, {**gpu(), "share": {"computeLimit": 0}}, True),
    (SHARED_GPU_DEVICE_CLASS, {**gpu(), "share": {"computeLimit": 101}}, True),
    (SHARED_GPU_DEVICE_CLASS, {**gpu(), "share": {"limit": 50}}, True),
    (GPU_DEVICE_CLASS, {**gpu(), "share": {"computeLimit": 70}}, True),
    (GPU_DEVICE_CLASS, {**gpu(), "share": {}}, True),
]


def admission_problems(device_class: str, parameters: object) -> list[str]:
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class}}],
                "config": [
                    {
                        "requests": ["gpu"],
                        "opaque": {"driver": DRIVER_NAME, "parameters": parameters},
                    }
                ],
            }
        },
    }
    return validate_resource_claim(claim)


class _OneClaim:
    def __init__(self, view: ClaimView) -> None:
        self.view = view

    def get(self, namespace: str, name: str) -> ClaimView | None:
        return self.view if (namespace, name) == (self.view.namespace, self.view.name) else None


def prepare_error(
    tmp_path: Path, device_class: str, parameters: object, device: AllocatedDevice | None = None
) -> str:
    backend = SimulatedBackend.from_topology("hgx-h100-8", NODE, state_path=tmp_path / "gpus.json")
    device = device or DEVICE_OF_CLASS[device_class]
    entry = {
        "source": "FromClaim",
        "requests": ["gpu"],
        "opaque": {"driver": DRIVER_NAME, "parameters": parameters},
    }
    view = ClaimView("uid-c", "ns", "c", True, (device,), (entry,))
    preparer = ClaimPreparerImpl(
        node_name=NODE,
        claims=_OneClaim(view),
        devices=NodeDevices(backend, shared={1}, dynamic_mig={0}),
        store=CheckpointStore(tmp_path / "data" / "checkpoint.json"),
        lock=PrepareLock(tmp_path / "data" / "lock"),
        cdi_dir=tmp_path / "cdi",
    )
    ref = ClaimRef("ns", "c", "uid-c")
    return preparer.prepare([ref])[ref.uid].error


@pytest.mark.parametrize(("device_class", "parameters", "refused"), TABLE)
def test_admission_and_prepare_agree(
    tmp_path: Path, device_class: str, parameters: object, refused: bool
) -> None:
    problems = admission_problems(device_class, parameters)
    error = prepare_error(tmp_path, device_class, parameters)
    assert bool(problems) is refused, problems
    if not refused:
        assert error == ""
        return
    if (device_class, parameters) == (SHARED_GPU_DEVICE_CLASS, mig()):
        return  # wrong kind: see test_a_config_of_the_wrong_kind_is_refused_by_both
    in_allocation = [p.removeprefix("spec.devices.") for p in problems]
    assert error == "claim ns/c: " + "; ".join(in_allocation)


def test_multi_user_is_refused_saying_why_and_what_to_do_instead() -> None:
    parameters = mig({"strategy": "MPS", "mpsConfig": {"multiUser": True}})
    (problem,) = admission_problems(MIG_DEVICE_CLASS, parameters)
    assert problem.startswith(
        "spec.devices.config[0].opaque.parameters.sharing.mpsConfig.multiUser: true is not "
        "supported: NVIDIA's DRA driver has no such setting, and the MPS control daemon "
        "flexgpu starts (MPS protocol 2) has no multi-user mode"
    )
    assert problem.endswith(
        "allowed: false, or leave it out and run the claim's containers as one user"
    )


def test_a_config_of_the_wrong_kind_is_refused_by_both(tmp_path: Path) -> None:
    # The texts differ here (prepare names the device it was given), the verdict does not.
    problems = admission_problems(GPU_DEVICE_CLASS, mig())
    assert len(problems) == 1 and "MigConfig cannot configure a whole GPU" in problems[0]
    error = prepare_error(tmp_path, GPU_DEVICE_CLASS, mig())
    assert "MigConfig cannot configure a whole GPU (gpu-2)" in error


def test_a_limit_below_the_compute_reserved_is_refused_by_both_with_one_text(
    tmp_path: Path,
) -> None:
    """Admission reads the compute the request asks for; prepare the compute the scheduler
    granted (the same, for a whole percent)."""
    parameters = {**gpu(), "share": {"computeLimit": 20}}
    claim = {
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": SHARED_GPU_DEVICE_CLASS,
                            "capacity": {"requests": {"memory": "8Gi", "compute": "30"}},
                        },
                    }
                ],
                "config": [
                    {
                        "requests": ["gpu"],
                        "opaque": {"driver": DRIVER_NAME, "parameters": parameters},
                    }
                ],
            }
        },
    }
    (problem,) = validate_resource_claim(claim)
    granted = AllocatedDevice(
        "gpu",
        DRIVER_NAME,
        NODE,
        "gpu-1",
        share_id="s1",
        consumed_capacity=parse_consumed_capacity({"memory": "8Gi", "compute": "30"}),
    )
    error = prepare_error(tmp_path, SHARED_GPU_DEVICE_CLASS, parameters, granted)
    assert error == "claim ns/c: " + problem.removeprefix("spec.devices.")
    assert "share.computeLimit: 20 is not allowed" in error
