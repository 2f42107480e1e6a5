"""A simulated H100 node for prepare tests: GPU 1 dynamic MIG, GPU 2 shared (MPS), the rest
whole; claims from a table standing in for the API server; a settable boot id; opaque configs
for time-slicing and for MPS on MIG devices."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexgpu.driver.claim_results import AllocatedDevice, parse_consumed_capacity
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.kubelet_plugin.claims.checkpoint import CheckpointStore, Writer
from flexgpu.kubelet_plugin.claims.claim_source import ClaimView
from flexgpu.kubelet_plugin.claims.prepare_lock import PrepareLock
from flexgpu.kubelet_plugin.claims.preparer import ClaimPreparerImpl
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef

NODE = "node-a"
DRIVER = "gpu.flexgpu.dev"
API = "gpu.flexgpu.dev/v1alpha1"
BOOT_A = "3f1c9a52-2b7e-4d0a-9c1e-5e8f7a6b4c3d"
BOOT_B = "8a2d4e6f-1b3c-4d5e-8f9a-0b1c2d3e4f5a"
DYNAMIC_GPU = 1
SHARED_GPU = 2


class ClaimTable:
    """ClaimSource over a dict; ``down`` makes every read fail like an unreachable API."""

    def __init__(self) -> None:
        self.views: dict[tuple[str, str], ClaimView] = {}
        self.down = False

    def add(
        self,
        name: str,
        *devices: AllocatedDevice,
        configs: tuple[dict[str, Any], ...] = (),
        namespace: str = "ns",
        pod_claim_name: str | None = None,
    ) -> ClaimRef:
        view = ClaimView(
            f"uid-{name}", namespace, name, True, tuple(devices), configs, pod_claim_name
        )
        self.views[(namespace, name)] = view
        return ClaimRef(namespace, name, view.uid)

    def get(self, namespace: str, name: str) -> ClaimView | None:
        if self.down:
            raise ConnectionError("apiserver unreachable")
        return self.views.get((namespace, name))


def device(name: str, request: str = "gpu", **kw: Any) -> AllocatedDevice:
    return AllocatedDevice(request=request, driver=DRIVER, pool=NODE, device=name, **kw)


def share(name: str, share_id: str, memory: str) -> AllocatedDevice:
    return device(
        name, share_id=share_id, consumed_capacity=parse_consumed_capacity({"memory": memory})
    )


def time_slicing(interval: str = "Long") -> dict[str, Any]:
    return {
        "source": "FromClaim",
        "opaque": {
            "driver": DRIVER,
            "parameters": {
                "apiVersion": API,
                "kind": "GpuConfig",
                "sharing": {
                    "strategy": "TimeSlicing",
                    "timeSlicingConfig": {"interval": interval},
                },
            },
        },
    }


def mig_mps(**mps_config: Any) -> dict[str, Any]:
    """A claim's MigConfig sharing its MIG devices with MPS (``mpsConfig`` as given)."""
    sharing: dict[str, Any] = {"strategy": "MPS"}
    if mps_config:
        sharing["mpsConfig"] = mps_config
    return {
        "source": "FromClaim",
        "opaque": {
            "driver": DRIVER,
            "parameters": {"apiVersion": API, "kind": "MigConfig", "sharing": sharing},
        },
    }


@dataclass
class Node:
    """One plugin's view of the node; ``restart()`` is a new plugin process on the same
    disk and (simulated) hardware."""

    root: Path
    table: ClaimTable
    boot_id: str = BOOT_A
    writer: Writer | None = None
    lock_timeout: float | None = 20
    # How long prepare waits for claims that hold its devices (holder_wait.py): 0 refuses at
    # once, what the tests of refusals check; test_holder_wait.py sets it.
    holder_wait_s: float = 0.0
    # The GPUs shared as fractions.
    shared: frozenset[int] = frozenset({SHARED_GPU})

    def __post_init__(self) -> None:
        self.restart()

    @property
    def data_dir(self) -> Path:
        return self.root / "data"

    def restart(self, boot_id: str | None = None) -> None:
        if boot_id is not None:
            self.boot_id = boot_id
        boot_file = self.root / "boot_id"
        boot_file.write_text(self.boot_id + "\n")
        self.backend = SimulatedBackend.from_topology(
            "hgx-h100-8", NODE, state_path=self.data_dir / "simulated-gpus.json"
        )
        self.devices = NodeDevices(self.backend, shared=set(self.shared), dynamic_mig={DYNAMIC_GPU})
        self.store = CheckpointStore(self.data_dir / "checkpoint.json", boot_file, self.writer)
        self.lock = PrepareLock(self.data_dir / "prepare.lock", timeout=self.lock_timeout)
        self.preparer = ClaimPreparerImpl(
            node_name=NODE,
            claims=self.table,
            devices=self.devices,
            store=self.store,
            lock=self.lock,
            cdi_dir=self.root / "cdi",
        )
        self.preparer.holders.wait_s = self.holder_wait_s
