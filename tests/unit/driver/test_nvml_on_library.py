"""NVML backend behaviour beyond the contract suite, through the unmodified pynvml module over
the NVML mock library (tools/nvml-mock): device numbers, NVLink grouping, sysfs facts, device
visibility, MIG state shared across processes, profile ids, process utilisation, error
translation of a failing library, shutdown, and the time-slice and MPS commands."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pynvml
import pytest
from conftest import LibraryNode

from flexgpu.driver.backend_errors import (
    BackendUnavailableError,
    GpuBackendError,
    NotFoundError,
    NotSupportedError,
    PermissionDeniedError,
)
from flexgpu.driver.gpu_model import MigPlacement, TimeSliceInterval
from flexgpu.driver.mps_daemon_spec import MigMpsDaemonSpec
from tests.conftest import wait_for
from tests.nvml_library import ENV_DEV_DIR, REPO, library_dir


def _uuid(i: int) -> str:
    return f"GPU-{i:08x}-0000-4000-8000-000000000000"


def _bus(i: int) -> str:
    return f"0000:{0x10 + i:02x}:00.0"


def _machine(model: str, count: int, **extra: Any) -> dict[str, Any]:
    gpus = [{"model": model, "uuid": _uuid(i), "pciBusId": _bus(i)} for i in range(count)]
    return {"gpus": gpus, **extra}


def _a100(mig: bool = True) -> dict[str, Any]:
    machine = _machine("A100-SXM4-80GB", 1)
    machine["gpus"][0]["migEnabled"] = mig
    return machine


def test_device_node_minor_number_is_reported(library_node: LibraryNode) -> None:
    backend, _ = library_node(_machine("T4", 2))
    assert [g.minor_number for g in backend.list_gpus()] == [0, 1]


def test_product_outside_the_catalog_has_no_multiprocessor_count(
    library_node: LibraryNode,
) -> None:
    # NVIDIA's DGX A100 mock names its GPUs "Mock NVIDIA A100-SXM4-40GB", which no catalog entry
    # matches, and NVML reports no SM count for a whole GPU.
    backend, _ = library_node({"machine": "dgxa100"})
    gpus = backend.list_gpus()
    assert len(gpus) == 8 and gpus[0].product_name == "Mock NVIDIA A100-SXM4-40GB"
    assert gpus[0].multiprocessors is None


def test_nvswitch_system_is_one_domain(library_node: LibraryNode) -> None:
    backend, _ = library_node(
        {"machine": "dgxh100", "nvswitch": {"gpus": list(range(8)), "links": 18}}
    )
    listed = backend.list_gpus()
    assert len({g.nvlink_domain for g in listed}) == 1
    assert listed[0].nvlink_peers == (1, 2, 3, 4, 5, 6, 7)


def test_direct_links_group_pairs(library_node: LibraryNode) -> None:
    links = [{"gpus": [0, 1], "links": 2}, {"gpus": [2, 3], "links": 1}]
    backend, _ = library_node(_machine("A100-SXM4-80GB", 4, nvlinks=links))
    listed = backend.list_gpus()
    domains = [g.nvlink_domain for g in listed]
    assert domains[0] == domains[1] != domains[2] == domains[3]
    assert listed[0].nvlink_peers == (1,) and listed[3].nvlink_peers == (2,)


def test_numa_and_pcie_root_from_sysfs(tmp_path: Path, library_node: LibraryNode) -> None:
    device = tmp_path / "sys" / "devices" / "pci0000:00" / "0000:00:01.0" / "0000:10:00.0"
    device.mkdir(parents=True)
    (device / "numa_node").write_text("1\n")
    links = tmp_path / "sys" / "bus" / "pci" / "devices"
    links.mkdir(parents=True)
    (links / "0000:10:00.0").symlink_to(device)
    backend, _ = library_node(_machine("T4", 1))
    info = backend.list_gpus()[0]
    assert (info.numa_node, info.pcie_root, info.pci_bus_id) == (1, "pci0000:00", "0000:10:00.0")


def test_only_gpus_with_a_visible_device_node_are_listed(
    tmp_path: Path, library_node: LibraryNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia2").touch()
    monkeypatch.setenv(ENV_DEV_DIR, str(dev))
    backend, _ = library_node(_machine("T4", 3))
    (only,) = backend.list_gpus()
    assert (only.index, only.uuid, only.minor_number) == (0, _uuid(2), 2)


def test_bad_machine_description_is_named_and_nvml_reports_no_driver(
    library_node: LibraryNode, capfd: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(BackendUnavailableError, match="NVML_ERROR_DRIVER_NOT_LOADED"):
        library_node({"gpus": [{"model": "V100"}]})
    error = capfd.readouterr().err
    assert 'gpus[0].model "V100": allowed values are' in error and "H100-SXM5-80GB" in error


def test_half_made_instance_is_listed_without_uuid(library_node: LibraryNode) -> None:
    backend, _ = library_node(_a100())
    # A GPU instance without a compute instance, as a crash between the two calls leaves it.
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    placement = pynvml.c_nvmlGpuInstancePlacement_t()
    placement.start, placement.size = 0, 2
    pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 14, ctypes.byref(placement))
    (device,) = backend.list_mig_devices(0)
    assert (device.profile_name, device.uuid, device.compute_instance_id) == ("2g.20gb", None, None)
    backend.destroy_mig_device(0, device.gpu_instance_id)
    assert backend.list_mig_devices(0) == []


def test_mig_calls_use_profile_ids(library_node: LibraryNode) -> None:
    backend, _ = library_node(_a100())
    device = backend.create_mig_device(0, 15, MigPlacement(start=6, size=2))
    assert device.profile_id == 15 and device.profile_name == "1g.20gb"
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    instance = pynvml.nvmlDeviceGetGpuInstanceById(handle, device.gpu_instance_id)
    # NVML reports the profile id (15), not the profile enum the mock keys it by (9).
    assert pynvml.nvmlGpuInstanceGetInfo(instance).profileId == 15


def test_mig_instances_outlive_the_process_that_made_them(library_node: LibraryNode) -> None:
    backend, machine = library_node(_a100())
    made = backend.create_mig_device(0, 9, MigPlacement(start=0, size=4))
    script = (
        "import json; from flexgpu.driver.nvml_backend import NvmlBackend; b = NvmlBackend(); "
        "print(json.dumps([d.model_dump(mode='json') for d in b.list_mig_devices(0)]))"
    )
    env = {**os.environ, **machine.env()}
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(result.stdout) == [made.model_dump(mode="json")]


def test_process_utilisation_is_merged(library_node: LibraryNode) -> None:
    backend, machine = library_node(_machine("T4", 1))
    machine.set_processes(
        0, [{"pid": 10, "usedMiB": 300, "smUtil": 55, "memUtil": 20}, {"pid": 11, "usedMiB": 100}]
    )
    first, second = backend.process_samples(0)
    assert (first.pid, first.used_memory_mib, first.sm_utilization_percent) == (10, 300, 55)
    assert first.memory_utilization_percent == 20 and first.gpu_instance_id is None
    assert (second.pid, second.sm_utilization_percent) == (11, None)
    # Samples already seen are not reported again.
    assert backend.process_samples(0)[0].sm_utilization_percent is None


def test_no_raw_nvml_error_escapes(library_node: LibraryNode) -> None:
    backend, machine = library_node(_machine("T4", 1))
    machine.state_path.write_text("{not json")  # the library answers NVML_ERROR_UNKNOWN
    with pytest.raises(GpuBackendError) as info:
        backend.get_compute_mode(0)
    assert not isinstance(info.value, pynvml.NVMLError)
    assert info.value.code == pynvml.NVML_ERROR_UNKNOWN


def test_close_shuts_nvml_down(library_node: LibraryNode) -> None:
    backend, _ = library_node(_machine("T4", 1))
    assert backend.wait_health_event(0) is None
    backend.close()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_library_answers_function_not_found_for_what_it_lacks(library_node: LibraryNode) -> None:
    library_node(_machine("T4", 1))
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
    assert (library_dir() / "libnvidia-ml.so.1").exists()


def test_library_checks_structure_versions_as_nvml_does(library_node: LibraryNode) -> None:
    library_node(_a100())
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
    function = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetGpuInstanceProfileInfoV")
    assert function(handle, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, ctypes.byref(info)) == 0
    assert (info.id, info.name) == (9, "MIG 3g.40gb")
    info.version = pynvml.nvmlGpuInstanceProfileInfo_v2 - 1  # size one byte short
    code = function(handle, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, ctypes.byref(info))
    assert code == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH


def test_mig_profiles_need_mig_mode_on_as_nvml_h_says(library_node: LibraryNode) -> None:
    # nvml.h: the versioned profile query answers NOT_SUPPORTED while MIG mode is off, so an
    # NVML node lists no profiles until MIG is on (the simulated backend lists them anyway).
    backend, _ = library_node(_a100(mig=False))
    assert backend.mig_profiles(0) == []
    backend.set_mig_mode(0, True)
    assert len(backend.mig_profiles(0)) == 7


def test_backend_reaches_only_functions_the_library_implements(
    library_node: LibraryNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The library answers FUNCTION_NOT_FOUND for NVML functions it lacks, which the backend
    # would quietly take as "not supported"; every symbol pynvml looks up for the backend's
    # work must be one the library exports itself.
    exported = {
        line.split()[1]
        for source in (REPO / "tools" / "nvml-mock").glob("*.go")
        for line in source.read_text().splitlines()
        if line.startswith("//export ")
    }
    looked_up: set[str] = set()
    original = pynvml._nvmlGetFunctionPointer

    def record(name: str) -> Any:
        looked_up.add(name)
        return original(name)

    monkeypatch.setattr(pynvml, "_nvmlGetFunctionPointer", record)
    machine = {
        "gpus": [
            {"model": "A100-SXM4-80GB", "migEnabled": True},
            {"model": "A100-SXM4-80GB"},
            {"model": "T4"},
        ],
        "nvlinks": [{"gpus": [0, 1], "links": 2}],
    }
    backend, library = library_node(machine)
    backend.list_gpus()
    backend.possible_placements(0, 9)
    device = backend.create_mig_device(0, 9, MigPlacement(start=0, size=4))
    backend.list_mig_devices(0)
    library.set_processes(0, [{"pid": 7, "usedMiB": 5, "gpuInstanceId": 1, "smUtil": 3}])
    backend.process_samples(0)
    library.set_processes(0, [])
    backend.destroy_mig_device(0, device.gpu_instance_id)
    backend.set_mig_mode(1, True)
    backend.set_compute_mode(2, backend.get_compute_mode(2))
    assert backend.wait_health_event(0) is None
    library.inject_xid(2, 79)
    assert backend.wait_health_event(2) is not None
    backend.close()
    assert looked_up and looked_up <= exported, sorted(looked_up - exported)


class _Recorder:
    def __init__(self, result: subprocess.CompletedProcess[str] | Exception) -> None:
        self.result = result
        self.argv: list[str] = []

    def __call__(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.argv = list(argv)
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


def test_time_slice_runs_nvidia_smi(library_node: LibraryNode) -> None:
    runner = _Recorder(subprocess.CompletedProcess([], 0, "", ""))
    backend, _ = library_node(_machine("T4", 1), run_command=runner)
    backend.set_time_slice(0, TimeSliceInterval.LONG)
    assert runner.argv == ["nvidia-smi", "compute-policy", "-i", _uuid(0), "--set-timeslice=3"]


@pytest.mark.parametrize(
    ("result", "error"),
    [
        (FileNotFoundError("nvidia-smi"), NotSupportedError),
        (subprocess.CompletedProcess([], 4, "", "Insufficient Permissions"), PermissionDeniedError),
        (subprocess.CompletedProcess([], 3, "Not Supported", ""), NotSupportedError),
        (subprocess.CompletedProcess([], 1, "", "boom"), GpuBackendError),
    ],
)
def test_time_slice_failures(
    library_node: LibraryNode,
    result: subprocess.CompletedProcess[str] | Exception,
    error: type[GpuBackendError],
) -> None:
    backend, _ = library_node(_machine("T4", 1), run_command=_Recorder(result))
    with pytest.raises(error):
        backend.set_time_slice(0, TimeSliceInterval.SHORT)


class _FakeMpsDaemons:
    """Runs the commands' MPS side as the real daemon would look from /proc: ``-d`` starts a
    process running a program named nvidia-cuda-mps-control with the command's environment,
    ``echo quit`` ends it. Other commands are only recorded."""

    def __init__(self, tmp_path: Path) -> None:
        self.calls: list[list[str]] = []
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.program = tmp_path / "bin" / "nvidia-cuda-mps-control"
        self.program.parent.mkdir()
        # One process, no child (a shell's forked `sleep` would briefly show this name too).
        self.program.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(600)\n")
        self.program.chmod(0o755)

    def __call__(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        env = dict(a.split("=", 1) for a in argv if "=" in a and a.startswith("CUDA_"))
        pipe = env["CUDA_MPS_PIPE_DIRECTORY"]
        if argv[-1].endswith("-d"):
            os.mkfifo(Path(pipe) / "control")  # the daemon's control pipe, as it makes it
            self.procs[pipe] = subprocess.Popen(
                [str(self.program)], env={**os.environ, **env}, start_new_session=True
            )
        if "echo quit" in argv[-1] and pipe in self.procs:
            ended = self.procs.pop(pipe)
            ended.kill()
            ended.wait()
        return subprocess.CompletedProcess(argv, 0, "", "")

    def close(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait()


@pytest.fixture
def fake_daemons(tmp_path: Path) -> Iterator[_FakeMpsDaemons]:
    daemons = _FakeMpsDaemons(tmp_path)
    yield daemons
    daemons.close()


def _wait_running(backend: Any, daemon: Any) -> None:
    wait_for(lambda: daemon in backend.mps_daemons(), what="the daemon's process")


def test_mps_daemon_is_started_with_the_gpu_pinned_and_adopted_when_alive(
    tmp_path: Path, library_node: LibraryNode, fake_daemons: _FakeMpsDaemons
) -> None:
    calls = fake_daemons.calls
    backend, _ = library_node(
        _machine("T4", 1), run_command=fake_daemons, mps_root=tmp_path / "mps"
    )
    daemon = backend.start_mps_daemon(0)
    assert calls[0][-1].endswith("exec nvidia-cuda-mps-control -d")
    shm = tmp_path / "mps" / _uuid(0) / "shm"
    assert calls[0][-1].startswith(f"mount --bind {shm} /dev/shm")
    assert f"CUDA_VISIBLE_DEVICES={_uuid(0)}" in calls[0]
    assert daemon.pipe_dir == str(tmp_path / "mps" / _uuid(0) / "pipe")
    _wait_running(backend, daemon)
    assert backend.start_mps_daemon(0) == daemon and len(calls) == 1  # adopted
    assert backend.mps_daemons() == [daemon]
    assert backend.get_compute_mode(0).name == "EXCLUSIVE_PROCESS"
    backend.stop_mps_daemon(0)
    assert calls[1][-3:] == ["sh", "-c", "echo quit | nvidia-cuda-mps-control"]
    assert backend.get_compute_mode(0).name == "DEFAULT"


def test_what_clients_leave_in_the_daemons_folders_is_never_trusted(
    tmp_path: Path, library_node: LibraryNode, fake_daemons: _FakeMpsDaemons
) -> None:
    """Clients mount the pipe and shm folders read-write: a pid file there naming a live
    process does not make a daemon run, and a new daemon starts in emptied folders whose
    symlinks were removed, not followed, with the daemon's modes."""
    backend, _ = library_node(
        _machine("T4", 1), run_command=fake_daemons, mps_root=tmp_path / "mps"
    )
    folder = tmp_path / "mps" / _uuid(0)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("host file")
    for name in ("pipe", "shm"):
        (folder / name).mkdir(parents=True)
        (folder / name / "link").symlink_to(victim)
        (folder / name / "sub").mkdir()
        (folder / name / "sub" / "link").symlink_to(victim / "keep")
    (folder / "pipe" / "nvidia-cuda-mps-control.pid").write_text(f"{os.getpid()}\n")
    os.mkfifo(folder / "pipe" / "control")
    assert backend.mps_daemons() == []  # the planted pid file names a live process: ignored

    daemon = backend.start_mps_daemon(0)
    assert len(fake_daemons.calls) == 1  # started, not adopted through the planted file
    # Only what the new daemon made: the planted pid file, FIFO and links are gone.
    assert sorted(p.name for p in Path(daemon.pipe_dir).iterdir()) == ["control"]
    # shm is also the /dev/shm of clients that may still run: its files stay, its links go.
    shm = Path(daemon.shm_dir)
    assert sorted(p.name for p in shm.iterdir()) == ["sub"] and not any(shm.rglob("link"))
    assert (victim / "keep").read_text() == "host file"
    assert Path(daemon.pipe_dir).stat().st_mode & 0o7777 == 0o755
    assert Path(daemon.log_dir).stat().st_mode & 0o7777 == 0o700
    assert Path(daemon.shm_dir).stat().st_mode & 0o7777 == 0o1777
    _wait_running(backend, daemon)

    # A client replaces the control pipe by a symlink: the plugin writes nothing through it
    # (as root that would write to the link's target) and ends the daemon by its process.
    control = Path(daemon.pipe_dir) / "control"
    control.unlink()
    control.symlink_to(victim / "keep")
    backend.stop_mps_daemon(0)
    assert not any("echo quit" in c[-1] for c in fake_daemons.calls)
    wait_for(lambda: backend.mps_daemons() == [], what="the daemon ended by SIGTERM")
    assert (victim / "keep").read_text() == "host file"
    # Stopped with its last claim: nothing of its clients stays for the GPU's next tenant.
    assert list(Path(daemon.pipe_dir).iterdir()) == [] and list(shm.iterdir()) == []


def test_mig_mps_daemon_sees_the_mig_devices_gets_the_limits_and_leaves_the_parent(
    tmp_path: Path, library_node: LibraryNode, fake_daemons: _FakeMpsDaemons
) -> None:
    calls = fake_daemons.calls
    backend, _ = library_node(_a100(), run_command=fake_daemons, mps_root=tmp_path / "mps")
    first = backend.create_mig_device(0, 19, MigPlacement(start=0, size=1))
    second = backend.create_mig_device(0, 19, MigPlacement(start=1, size=1))
    uuids = tuple(sorted(u for u in (first.uuid, second.uuid) if u))
    spec = MigMpsDaemonSpec(0, uuids, 40, (1024, None))
    mode = backend.get_compute_mode(0)

    daemon = backend.start_mig_mps_daemon(spec)

    assert (daemon.gpu_index, daemon.gpu_uuid) == (0, uuids[0])
    assert daemon.pipe_dir == str(tmp_path / "mps" / uuids[0] / "pipe")
    start, *configure = calls
    assert f"CUDA_VISIBLE_DEVICES={uuids[0]},{uuids[1]}" in start
    assert start[-1].endswith("exec nvidia-cuda-mps-control -d")
    assert [c[-1] for c in configure] == [
        "echo set_default_active_thread_percentage 40 | nvidia-cuda-mps-control",
        f"echo set_default_device_pinned_mem_limit {uuids[0]} 1024M | nvidia-cuda-mps-control",
    ]
    assert backend.get_compute_mode(0) == mode  # the parent's: other partitions share it
    _wait_running(backend, daemon)
    backend.stop_mig_mps_daemon(0, uuids[0])
    assert calls[-1][-1] == "echo quit | nvidia-cuda-mps-control"
    wait_for(lambda: backend.mps_daemons() == [], what="the daemon's end")
    assert backend.get_compute_mode(0) == mode
    with pytest.raises(NotFoundError):
        backend.start_mig_mps_daemon(
            MigMpsDaemonSpec(0, ("MIG-00000000-0000-0000-0000-000000000000",))
        )


def test_gpu_usage_reads_device_figures(library_node: LibraryNode) -> None:
    backend, machine = library_node(_machine("T4", 1))
    machine.set_processes(
        0, [{"pid": 10, "usedMiB": 300, "smUtil": 55}, {"pid": 11, "usedMiB": 100}]
    )
    usage = backend.gpu_usage(0)
    # nvmlDeviceGetUtilizationRates and nvmlDeviceGetMemoryInfo, not sums of the samples.
    assert (usage.sm_utilization_percent, usage.memory_used_mib, len(usage.processes)) == (
        55,
        400,
        2,
    )
    assert usage.mig == ()


def test_gpu_usage_of_mig_instances(library_node: LibraryNode) -> None:
    backend, machine = library_node(_a100())
    profile = next(p for p in backend.mig_profiles(0) if p.name.startswith("1g."))
    made = backend.create_mig_device(0, profile.profile_id, profile.placements[0])
    gi = made.gpu_instance_id
    machine.set_processes(0, [{"pid": 20, "usedMiB": 700, "smUtil": 30, "gpuInstanceId": gi}])
    usage = backend.gpu_usage(0)
    # MIG mode: NVML has no device utilisation; the instance has its memory and processes.
    assert usage.sm_utilization_percent is None
    (instance,) = usage.mig
    assert (instance.gpu_instance_id, instance.memory_used_mib) == (gi, 700)
    assert [p.pid for p in instance.processes] == [20]
    assert instance.sm_utilization_percent == 30
