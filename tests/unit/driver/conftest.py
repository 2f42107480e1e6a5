"""Shared fixtures: the same hardware behind the simulated backend and behind the NVML backend over
the NVML mock library (the unmodified pynvml module loading a C library over NVIDIA's mock NVML
servers), for the contract suite; and NVML backends over the library on other machines."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pynvml
import pytest

from flexgpu.driver.backend import GpuBackend
from flexgpu.driver.gpu_model import ProcessSample
from flexgpu.driver.nvml_backend import NvmlBackend
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.sysfs import SysfsPci
from flexgpu.driver.topology import parse_topology
from tests.nvml_library import ENV_CONFIG, ENV_STATE, MockMachine, load_into_process


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
class LibraryHardware:
    """The NVML mock library's machine, changed through the library's own controls."""

    machine: MockMachine

    def inject_xid(self, index: int, xid: int) -> None:
        self.machine.inject_xid(index, xid)

    def lose_gpu(self, index: int) -> None:
        self.machine.set_lost(index)

    def run_process(self, index: int, pid: int, used_mib: int, gpu_instance_id: int) -> None:
        process = {"pid": pid, "usedMiB": used_mib, "gpuInstanceId": gpu_instance_id}
        self.machine.set_processes(index, [process])

    def stop_processes(self, index: int) -> None:
        self.machine.set_processes(index, [])


# GPU 0: A100-SXM4-80GB with MIG enabled; GPU 1: T4 (no MIG); no NVLink between them.
CONTRACT_TOPOLOGY = {
    "name": "contract",
    "gpus": [
        {"model": "A100-SXM4-80GB", "pciBusId": "0000:07:00.0", "migEnabled": True},
        {"model": "T4", "pciBusId": "0000:3b:00.0"},
    ],
}


A100_UUID = "GPU-5e1f0c8a-2b7d-4a61-9c3e-0d4b8f7a1c22"
T4_UUID = "GPU-9a3c7e21-64f0-4b8d-a1e5-3c2f9d0b7e44"

# The same machine for the NVML mock library: the A100 from NVIDIA's mock tables, the T4 from
# the library's own definition (the mock servers have no GPU without MIG).
CONTRACT_LIBRARY_MACHINE = {
    "driverVersion": "580.95.05",
    "cudaDriverVersion": 13000,
    "gpus": [
        {
            "model": "A100-SXM4-80GB",
            "uuid": A100_UUID,
            "pciBusId": "0000:07:00.0",
            "migEnabled": True,
        },
        {"model": "T4", "uuid": T4_UUID, "pciBusId": "0000:3b:00.0"},
    ],
}


class LibraryNode(Protocol):
    """Starts the NVML backend over the NVML mock library on a described machine."""

    def __call__(
        self, description: dict[str, Any], **backend_options: Any
    ) -> tuple[NvmlBackend, MockMachine]: ...


@pytest.fixture
def library_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LibraryNode]:
    """The NVML backend on the unmodified pynvml module over the NVML mock library; sysfs is
    read under ``tmp_path/sys``. One machine per test."""
    load_into_process()
    # The library reads its machine at the first nvmlInit of a process; one left initialised
    # by an earlier test would serve that test's machine here.
    assert pynvml._nvmlLib_refcount == 0, "an earlier test left NVML initialised"
    started: list[NvmlBackend] = []

    def start(
        description: dict[str, Any], **backend_options: Any
    ) -> tuple[NvmlBackend, MockMachine]:
        machine = MockMachine.write(tmp_path / "nvml", description)
        monkeypatch.setenv(ENV_CONFIG, str(machine.config_path))
        monkeypatch.setenv(ENV_STATE, str(machine.state_path))
        options = {"sysfs": SysfsPci(tmp_path / "sys"), **backend_options}
        backend = NvmlBackend(**options)
        started.append(backend)
        return backend, machine

    yield start
    for backend in started:
        backend.close()


@pytest.fixture(params=["simulated", "nvml-library"])
def contract(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[GpuBackend, Hardware]]:
    if request.param == "simulated":
        topology = parse_topology(CONTRACT_TOPOLOGY)
        sim = SimulatedBackend(topology, "contract-node", tmp_path / "state.json")
        yield sim, SimulatedHardware(sim)
    else:
        start: LibraryNode = request.getfixturevalue("library_node")
        backend, machine = start(CONTRACT_LIBRARY_MACHINE)
        yield backend, LibraryHardware(machine)
