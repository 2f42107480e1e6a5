"""The simulated GPUs' load: which processes run on them and how busy they are, read from a
JSON file that tests and the demo write while the simulated node runs (the plugin is another
process, so the file is how they drive it). Beside the simulated state file, named
``simulated-usage.json``::

    {"gpus": {"0": {"smUtilization": 85,
                    "processes": [{"pid": 4242, "usedMemoryMiB": 2048, "smUtilization": 85,
                                   "gpuInstanceId": 1}]}}}

GPUs are keyed by index. ``smUtilization`` of a GPU is optional (default: the capped sum of
its processes'). The file is re-read when it changes; a missing file means idle GPUs, and a
file that does not parse keeps the last good load and says why (a half-written file is
normal while a test rewrites it).
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flexgpu.driver.gpu_model import ProcessSample

log = logging.getLogger(__name__)

USAGE_FILE_NAME = "simulated-usage.json"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class SimulatedProcess(_Model):
    pid: int = Field(ge=1)
    used_memory_mib: int | None = Field(default=None, ge=0, alias="usedMemoryMiB")
    sm_utilization: int | None = Field(default=None, ge=0, le=100, alias="smUtilization")
    memory_utilization: int | None = Field(default=None, ge=0, le=100, alias="memoryUtilization")
    gpu_instance_id: int | None = Field(default=None, ge=0, alias="gpuInstanceId")

    def sample(self) -> ProcessSample:
        return ProcessSample(
            pid=self.pid,
            used_memory_mib=self.used_memory_mib,
            sm_utilization_percent=self.sm_utilization,
            memory_utilization_percent=self.memory_utilization,
            gpu_instance_id=self.gpu_instance_id,
            compute_instance_id=0 if self.gpu_instance_id is not None else None,
        )


class SimulatedGpuLoad(_Model):
    sm_utilization: int | None = Field(default=None, ge=0, le=100, alias="smUtilization")
    processes: list[SimulatedProcess] = []


class SimulatedUsage(_Model):
    gpus: dict[int, SimulatedGpuLoad] = {}


class UsageFile:
    """The load in ``path``, re-read when its modification time or size changes."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self._usage = SimulatedUsage()

    def current(self) -> SimulatedUsage:
        if self.path is None:
            return self._usage
        with self._lock:
            try:
                st = self.path.stat()
            except FileNotFoundError:
                self._stamp, self._usage = None, SimulatedUsage()
                return self._usage
            except OSError as err:
                log.warning("cannot read simulated usage %s: %s", self.path, err.strerror)
                return self._usage
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                try:
                    self._usage = SimulatedUsage.model_validate(json.loads(self.path.read_text()))
                    self._stamp = stamp
                except (OSError, ValueError, ValidationError) as err:
                    log.warning("simulated usage %s not used: %s", self.path, err)
            return self._usage

    def processes(self, index: int) -> list[ProcessSample]:
        load = self.current().gpus.get(index)
        return [p.sample() for p in load.processes] if load else []

    def sm_utilization(self, index: int) -> int | None:
        load = self.current().gpus.get(index)
        return load.sm_utilization if load else None
