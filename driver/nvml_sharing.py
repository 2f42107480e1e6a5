"""How a GPU is shared, through NVML and the driver's tools: compute mode, time slices
(``nvidia-smi compute-policy``) and MPS control daemons (``nvidia-cuda-mps-control``), one per
GPU or per claim's MIG devices, in folders whose contents are never trusted (mps_folders.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pynvml

from flexgpu.driver.backend_errors import (
    GpuBackendError,
    NotFoundError,
    NotSupportedError,
    PermissionDeniedError,
)
from flexgpu.driver.gpu_model import (
    ComputeMode,
    MpsDaemon,
    TimeSliceInterval,
)
from flexgpu.driver.mps_daemon_spec import MigMpsDaemonSpec
from flexgpu.driver.mps_folders import (
    control_daemon_pid,
    control_daemon_running,
    control_pipe_problem,
    empty_daemon_folders,
    prepare_daemon_folders,
)
from flexgpu.driver.nvml_calls import NvmlCalls, nvml_text

_COMPUTE_MODES = {
    pynvml.NVML_COMPUTEMODE_DEFAULT: ComputeMode.DEFAULT,
    pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: ComputeMode.EXCLUSIVE_PROCESS,
    pynvml.NVML_COMPUTEMODE_PROHIBITED: ComputeMode.PROHIBITED,
}
# nvidia-smi compute-policy --set-timeslice takes these numbers.
_TIME_SLICE_ARGUMENT = {
    TimeSliceInterval.DEFAULT: "0",
    TimeSliceInterval.SHORT: "1",
    TimeSliceInterval.MEDIUM: "2",
    TimeSliceInterval.LONG: "3",
}


# Host folder for MPS pipes and logs, one sub-folder per GPU UUID; mounted into containers.
DEFAULT_MPS_ROOT = Path("/run/flexgpu/mps")
_MPS_STOP_TIMEOUT_S = 10.0


def run_tool(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=30, check=False)


class NvmlSharing(NvmlCalls):
    def get_compute_mode(self, index: int) -> ComputeMode:
        with self._lock:
            mode = int(self._call("nvmlDeviceGetComputeMode", self._handle(index)))
            if mode not in _COMPUTE_MODES:
                raise NotSupportedError(f"GPU {index} reports unknown compute mode {mode}")
            return _COMPUTE_MODES[mode]

    def set_compute_mode(self, index: int, mode: ComputeMode) -> None:
        with self._lock:
            code = next(k for k, v in _COMPUTE_MODES.items() if v == mode)
            self._call(
                "nvmlDeviceSetComputeMode",
                self._handle(index),
                code,
                context=f"set compute mode {mode} on GPU {index}",
            )

    def set_time_slice(self, index: int, interval: TimeSliceInterval) -> None:
        # NVML has no call for this outside vGPU; the driver's own tool sets it.
        with self._lock:
            uuid = nvml_text(self._call("nvmlDeviceGetUUID", self._handle(index)))
        argv = [
            self._nvidia_smi,
            "compute-policy",
            "-i",
            uuid,
            f"--set-timeslice={_TIME_SLICE_ARGUMENT[interval]}",
        ]
        try:
            result = self._run_command(argv)
        except FileNotFoundError:
            raise NotSupportedError(
                f"cannot set time slice on GPU {index}: {self._nvidia_smi} not found"
            ) from None
        except (OSError, subprocess.SubprocessError) as exc:
            raise GpuBackendError(f"cannot set time slice on GPU {index}: {exc}") from None
        if result.returncode != 0:
            output = (result.stderr or result.stdout or "").strip()
            message = f"set time slice {interval} on GPU {index}: {output}"
            lowered = output.lower()
            if "permission" in lowered:
                raise PermissionDeniedError(message)
            if "not supported" in lowered:
                raise NotSupportedError(message)
            raise GpuBackendError(message)

    # -- MPS -----------------------------------------------------------------------------

    def _mps_daemon(self, index: int, uuid: str) -> MpsDaemon:
        folder = self._mps_root / uuid
        return MpsDaemon(
            gpu_index=index,
            gpu_uuid=uuid,
            pipe_dir=str(folder / "pipe"),
            log_dir=str(folder / "log"),
            shm_dir=str(folder / "shm"),
        )

    @staticmethod
    def _mps_alive(daemon: MpsDaemon) -> bool:
        # Found by its process, not by the pid file it writes into the pipe folder: clients
        # mount that folder read-write, so the file may be theirs (mps_folders.py).
        return control_daemon_running(daemon.pipe_dir)

    def _mps_command(
        self,
        daemon: MpsDaemon,
        index: int,
        action: str,
        *argv: str,
        visible: str | None = None,
    ) -> None:
        env = [
            "env",
            f"CUDA_VISIBLE_DEVICES={visible or daemon.gpu_uuid}",
            f"CUDA_MPS_PIPE_DIRECTORY={daemon.pipe_dir}",
            f"CUDA_MPS_LOG_DIRECTORY={daemon.log_dir}",
        ]
        try:
            result = self._run_command([*env, *argv])
        except FileNotFoundError:
            raise NotSupportedError(
                f"cannot {action} MPS on GPU {index}: {self._mps_control} not found"
            ) from None
        except (OSError, subprocess.SubprocessError) as exc:
            raise GpuBackendError(f"cannot {action} MPS on GPU {index}: {exc}") from None
        if result.returncode != 0:
            output = (result.stderr or result.stdout or "").strip()
            if result.returncode == 127:
                raise NotSupportedError(
                    f"cannot {action} MPS on GPU {index}: {self._mps_control} not found"
                )
            raise GpuBackendError(f"{action} MPS on GPU {index}: {output}")

    def start_mps_daemon(self, index: int) -> MpsDaemon:
        with self._lock:
            uuid = nvml_text(self._call("nvmlDeviceGetUUID", self._handle(index)))
        daemon = self._mps_daemon(index, uuid)
        if self._mps_alive(daemon):
            return daemon
        self.set_compute_mode(index, ComputeMode.EXCLUSIVE_PROCESS)
        self._launch_mps(daemon, index, uuid)
        return daemon

    def _launch_mps(self, daemon: MpsDaemon, index: int, visible: str) -> None:
        # What an earlier daemon's clients left there (a FIFO, a symlink, a pid file) is never
        # served or trusted (mps_folders.py).
        prepare_daemon_folders(daemon.pipe_dir, daemon.log_dir, daemon.shm_dir)
        # The daemon gets a mount namespace of its own whose /dev/shm is the GPU's shm folder;
        # clients get the same folder at /dev/shm through their CDI mounts.
        script = f"mount --bind {daemon.shm_dir} /dev/shm && exec {self._mps_control} -d"
        self._mps_command(
            daemon,
            index,
            "start",
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            visible=visible,
        )

    def start_mig_mps_daemon(self, spec: MigMpsDaemonSpec) -> MpsDaemon:
        live = {
            m.uuid
            for gpu in self.list_gpus()
            for m in self.list_mig_devices(gpu.index)
            if m.uuid is not None
        }
        missing = [u for u in spec.device_uuids if u not in live]
        if missing:
            raise NotFoundError(f"no MIG device {', '.join(missing)}: cannot start its MPS daemon")
        daemon = self._mps_daemon(spec.parent_index, spec.key)
        # No compute mode change: it is the parent GPU's, and its other partitions are
        # other claims'.
        if not self._mps_alive(daemon):
            self._launch_mps(daemon, spec.parent_index, spec.visible_devices)
        # Told again to an adopted daemon too: setting a default twice changes nothing.
        commands = spec.control_commands()
        problem = control_pipe_problem(daemon.pipe_dir) if commands else None
        if problem is not None:
            raise GpuBackendError(f"not telling the MPS daemon of {spec.key} its limits: {problem}")
        for command in commands:
            self._mps_command(
                daemon,
                spec.parent_index,
                "configure",
                "sh",
                "-c",
                f"echo {command} | {self._mps_control}",
                visible=spec.visible_devices,
            )
        return daemon

    def stop_mps_daemon(self, index: int) -> None:
        with self._lock:
            uuid = nvml_text(self._call("nvmlDeviceGetUUID", self._handle(index)))
        self._stop_mps(self._mps_daemon(index, uuid), index)
        self.set_compute_mode(index, ComputeMode.DEFAULT)

    def stop_mig_mps_daemon(self, parent_index: int, uuid: str) -> None:
        self._stop_mps(self._mps_daemon(parent_index, uuid), parent_index)

    def _stop_mps(self, daemon: MpsDaemon, index: int) -> None:
        """``quit`` on the control pipe; through a pipe a client replaced, SIGTERM to the
        daemon's process instead (never a write as root to whatever the pipe now is)."""
        pid = control_daemon_pid(daemon.pipe_dir)
        if pid is not None and control_pipe_problem(daemon.pipe_dir) is None:
            self._mps_command(daemon, index, "stop", "sh", "-c", f"echo quit | {self._mps_control}")
        elif pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        # Its last claim gone, nothing of its clients stays for the GPU's next tenant; once it
        # has ended (a daemon still running keeps its files: the unprepare fails and is
        # tried again, its record kept).
        deadline = time.monotonic() + _MPS_STOP_TIMEOUT_S
        while control_daemon_pid(daemon.pipe_dir) is not None:
            if time.monotonic() > deadline:
                raise GpuBackendError(
                    f"the MPS daemon of {daemon.gpu_uuid} did not end within "
                    f"{_MPS_STOP_TIMEOUT_S:.0f} s of being told to"
                )
            time.sleep(0.05)
        empty_daemon_folders(daemon.pipe_dir, daemon.shm_dir)

    def mps_daemons(self) -> list[MpsDaemon]:
        running = []
        for gpu in self.list_gpus():
            # A MIG device daemon's folder is named after its first device's UUID.
            keys = [gpu.uuid] + [m.uuid for m in self.list_mig_devices(gpu.index) if m.uuid]
            for key in keys:
                daemon = self._mps_daemon(gpu.index, key)
                if self._mps_alive(daemon):
                    running.append(daemon)
        return running
