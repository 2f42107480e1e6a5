"""A whole-GPU claim on a dynamic-MIG GPU gets the GPU itself (GPU UUID, MIG mode off), a
partition claim switches MIG mode on; where switching needs a GPU reset, the GPU publishes no
whole-GPU device, so no claim ever receives something other than what its device promised."""

from __future__ import annotations

import json
from pathlib import Path

from flexgpu.driver.gpu_model import MigMode, TimeSliceInterval
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.claims.prepare_records import device_status
from flexgpu.kubelet_plugin.claims.sharing import SharingPlan
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from tests.unit.kubelet_plugin.prepare_support import (
    DYNAMIC_GPU,
    ClaimTable,
    Node,
    device,
    time_slicing,
)

WHOLE = f"gpu-{DYNAMIC_GPU}"
PARTITION = f"gpu-{DYNAMIC_GPU}-mig-1g10gb-6"


def _granted_uuid(node: Node, uid: str) -> str:
    spec = json.loads(node.preparer.spec_path(uid).read_text())
    cdi, _metadata = spec["devices"]
    (own,) = [e for e in cdi["containerEdits"]["env"] if e.startswith("FLEXGPU_DEVICE_")]
    return str(own.split("=", 2)[2].split(";")[0])


def test_whole_gpu_claims_get_the_gpu_and_partitions_switch_mig_on(tmp_path: Path) -> None:
    node = Node(tmp_path, ClaimTable())
    gpu_uuid = node.devices.gpus_by_index()[DYNAMIC_GPU].uuid
    assert node.devices.partition(WHOLE) is None
    assert node.backend.get_mig_mode(DYNAMIC_GPU).current is False  # idle: ready for a whole GPU

    whole = node.table.add("whole", device(WHOLE), configs=(time_slicing("Short"),))
    assert not node.preparer.prepare([whole])[whole.uid].error
    assert _granted_uuid(node, whole.uid) == gpu_uuid
    assert node.backend.list_mig_devices(DYNAMIC_GPU) == []
    # Time-slicing lands on a real GPU, not on a MIG device.
    assert node.backend.time_slice(DYNAMIC_GPU) == TimeSliceInterval.SHORT
    assert not node.preparer.unprepare([whole])[whole.uid].error

    part = node.table.add("part", device(PARTITION))
    assert not node.preparer.prepare([part])[part.uid].error
    assert node.backend.get_mig_mode(DYNAMIC_GPU).current is True
    (instance,) = node.backend.list_mig_devices(DYNAMIC_GPU)
    assert _granted_uuid(node, part.uid) == instance.uuid
    assert not node.preparer.unprepare([part])[part.uid].error

    again = node.table.add("again", device(WHOLE))
    assert not node.preparer.prepare([again])[again.uid].error
    assert node.backend.get_mig_mode(DYNAMIC_GPU).current is False
    assert _granted_uuid(node, again.uid) == gpu_uuid


class ResetToSwitch(SimulatedBackend):
    """A GPU whose MIG mode change waits for a reset (the NVML answer RESET_REQUIRED)."""

    def set_mig_mode(self, index: int, enabled: bool) -> MigMode:
        current = self.get_mig_mode(index).current
        return MigMode(current=current, pending=enabled)


def test_a_gpu_that_needs_a_reset_publishes_partitions_only(tmp_path: Path) -> None:
    backend = ResetToSwitch.from_topology(
        "hgx-h100-8", "node-a", state_path=tmp_path / "state.json"
    )
    SimulatedBackend.set_mig_mode(backend, DYNAMIC_GPU, True)  # MIG mode on, as an admin left it
    devices = NodeDevices(backend, dynamic_mig={DYNAMIC_GPU})
    names = {d["name"] for d in devices.slice_devices()}
    assert WHOLE not in names and PARTITION in names
    assert backend.get_mig_mode(DYNAMIC_GPU).current is True
    assert devices.device_type(PARTITION) == "mig"


def test_status_of_a_whole_gpu_names_the_product_not_a_mig_profile(tmp_path: Path) -> None:
    node = Node(tmp_path, ClaimTable())
    resolved = node.devices.resolve(WHOLE)
    assert resolved is not None
    # What the claim's status (and the demo table) shows for the device.
    (status,) = device_status(node.devices, [device(WHOLE)], [resolved], SharingPlan())
    assert "migProfile" not in status.data
    assert status.data["productName"] == node.devices.gpus_by_index()[DYNAMIC_GPU].product_name
