"""Shared fixtures: the same simulated hardware behind either backend, for the contract suite."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pytest
from fake_pynvml import FakeNvml, a100_80gb, fake_process, t4

from driver.backend import GpuBackend
from driver.gpu_model import ProcessSample
from driver.nvml_backend import NvmlBackend
from driver.sim_backend import SimulatedBackend
from driver.sysfs import SysfsPci
from driver.topology import parse_topology


class Hardware(Protocol):
    """Test-only controls over the hardware behind a backend."""

    def inject_xid(self, index: int, xid: int) -> None: ...
    def lose_gpu(self, index: int) -> None: ...
    def run_process(self, index: int, pid: int, used_mib: int, gpu_instance_id: int) -> None: ...
    def stop_processes(self, index: int) -> None: ...


@dataclass
class SimulatedHardware:
    backend: SimulatedBackend

    def inject_xid(self, index: int, xid: int) -> None:
        self.backend.inject_xid(index, xid)

    def lose_gpu(self, index: int) -> None:
        self.backend.lose_gpu(index)

    def run_process(self, index: int, pid: int, used_mib: int, gpu_instance_id: int) -> None:
        sample = ProcessSample(pid=pid, used_memory_mib=used_mib, gpu_instance_id=gpu_instance_id)
        self.backend.set_processes(index, [sample])

    def stop_processes(self, index: int) -> None:
        self.backend.set_processes(index, [])


@dataclass
class StubbedNvmlHardware:
    nvml: FakeNvml

    def inject_xid(self, index: int, xid: int) -> None:
        self.nvml.raise_xid(index, xid)

    def lose_gpu(self, index: int) -> None:
        self.nvml.lose_gpu(index)

    def run_process(self, index: int, pid: int, used_mib: int, gpu_instance_id: int) -> None:
        self.nvml.gpus[index].processes = [fake_process(pid, used_mib, gpu_instance_id)]

    def stop_processes(self, index: int) -> None:
        self.nvml.gpus[index].processes = []


# GPU 0: A100-SXM4-80GB with MIG enabled; GPU 1: T4 (no MIG); no NVLink between them.
CONTRACT_TOPOLOGY = {
    "name": "contract",
    "gpus": [
        {"model": "A100-SXM4-80GB", "pciBusId": "0000:07:00.0", "migEnabled": True},
        {"model": "T4", "pciBusId": "0000:3b:00.0"},
    ],
}


def contract_fake_nvml() -> FakeNvml:
    return FakeNvml(
        [
            a100_80gb("GPU-5e1f0c8a-2b7d-4a61-9c3e-0d4b8f7a1c22", "00000000:07:00.0"),
            t4("GPU-9a3c7e21-64f0-4b8d-a1e5-3c2f9d0b7e44", "00000000:3B:00.0"),
        ]
    )


@pytest.fixture(params=["simulated", "nvml-stub"])
def contract(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[GpuBackend, Hardware]]:
    if request.param == "simulated":
        topology = parse_topology(CONTRACT_TOPOLOGY)
        sim = SimulatedBackend(topology, "contract-node", tmp_path / "state.json")
        yield sim, SimulatedHardware(sim)
    else:
        nvml = contract_fake_nvml()
        backend = NvmlBackend(nvml=nvml, sysfs=SysfsPci(tmp_path / "no-sysfs"))
        yield backend, StubbedNvmlHardware(nvml)
        backend.close()
