"""Simulated GPU backend: GPUs from the catalog laid out by a topology file, following the rules
NVML enforces, with state that persists across restarts like real hardware and with fault
injection for tests.

Many simulated nodes can live in one process: each backend has its own node name, state file and
lock. Without a state file the backend keeps its state in memory (read-only listings, tests).
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path

from flexgpu.driver.backend import GpuBackend
from flexgpu.driver.backend_errors import (
    GpuLostError,
    InUseError,
    InvalidArgumentError,
    NotFoundError,
    NotSupportedError,
)
from flexgpu.driver.gpu_catalog import GpuModelSpec, gpu_model
from flexgpu.driver.gpu_model import (
    ComputeMode,
    GpuInfo,
    HealthEvent,
    HealthEventKind,
    HealthState,
    MigDevice,
    MigMode,
    MigPlacement,
    MigProfile,
    MpsDaemon,
    ProcessSample,
    TimeSliceInterval,
)
from flexgpu.driver.mig_rules import check_mig_fit, gpu_instance_id_for
from flexgpu.driver.mps_daemon_spec import MigMpsDaemonSpec
from flexgpu.driver.nvlink import NVSWITCH, nvlink_domains, nvlink_peers
from flexgpu.driver.sim_faults import FaultPlan
from flexgpu.driver.sim_state import (
    SimulatedGpuState,
    SimulatedMigInstance,
    SimulatedMigMpsDaemon,
    SimulatedNodeState,
    SimulatedStateError,
    load_state,
    save_state,
)
from flexgpu.driver.sim_usage import USAGE_FILE_NAME, UsageFile
from flexgpu.driver.topology import NodeTopology, load_topology
from flexgpu.driver.usage import GpuUsage, usage_from_processes
from flexgpu.driver.uuids import simulated_gpu_uuid, simulated_mig_uuid
from flexgpu.driver.xid import xid_marks_unhealthy


class SimulatedBackend(GpuBackend):
    def __init__(
        self,
        topology: NodeTopology,
        node_name: str,
        state_path: str | os.PathLike[str] | None = None,
        mps_root: str | os.PathLike[str] | None = None,
    ) -> None:
        self._topology = topology
        # Where simulated MPS pipe and log folders go (containers mount them via CDI).
        # Without a state file or a root the node lives only in memory, and so do its
        # daemons: their temporary root is made on first use and removed with the backend.
        self._mps_root: Path | None = None
        if mps_root is not None:
            self._mps_root = Path(mps_root)
        elif state_path is not None:
            self._mps_root = Path(state_path).parent / "mps"
        self._node_name = node_name
        self._state_path = Path(state_path) if state_path is not None else None
        self._lock = threading.RLock()
        self._specs: list[GpuModelSpec] = [gpu_model(g.model) for g in topology.gpus]
        self._uuids = [simulated_gpu_uuid(node_name, i) for i in range(len(topology.gpus))]
        links = self._nvlink_links()
        self._domains = nvlink_domains(links)
        index_of = {uuid: i for i, uuid in enumerate(self._uuids)}
        self._peers = {
            index_of[uuid]: tuple(sorted(index_of[p] for p in peers))
            for uuid, peers in nvlink_peers(links).items()
        }
        self._state = self._load_or_initial_state()
        self._events: queue.Queue[HealthEvent] = queue.Queue()
        self._unhealthy: set[int] = set()
        self._processes: dict[int, list[ProcessSample]] = {}
        # Load that tests and the demo set from outside the process (driver/sim_usage.py).
        self.usage_file = UsageFile(
            self._state_path.parent / USAGE_FILE_NAME if self._state_path else None
        )
        self.faults = FaultPlan()

    @classmethod
    def from_topology(
        cls,
        topology_ref: str | os.PathLike[str],
        node_name: str,
        state_path: str | os.PathLike[str] | None = None,
        mps_root: str | os.PathLike[str] | None = None,
    ) -> SimulatedBackend:
        """Build from a built-in topology name or a topology file path."""
        ref = topology_ref if isinstance(topology_ref, str) else Path(topology_ref)
        return cls(load_topology(ref), node_name, state_path, mps_root)

    @property
    def node_name(self) -> str:
        return self._node_name

    # -- setup ---------------------------------------------------------------------------

    def _nvlink_links(self) -> dict[str, set[str]]:
        fabric = self._topology.nvlink
        links: dict[str, set[str]] = {uuid: set() for uuid in self._uuids}
        if fabric.fabric == "nvswitch":
            for partners in links.values():
                partners.add(NVSWITCH)
        for a, b in fabric.links:
            links[self._uuids[a]].add(self._uuids[b])
        return links

    def _load_or_initial_state(self) -> SimulatedNodeState:
        saved = load_state(self._state_path) if self._state_path else None
        if saved is None:
            state = SimulatedNodeState(
                node_name=self._node_name,
                topology=self._topology.name,
                gpus=[SimulatedGpuState(mig_enabled=g.mig_enabled) for g in self._topology.gpus],
            )
            self._save(state)
            return state
        if (
            saved.node_name != self._node_name
            or saved.topology != self._topology.name
            or len(saved.gpus) != len(self._topology.gpus)
        ):
            raise SimulatedStateError(
                f"{self._state_path}: state of node {saved.node_name!r} with topology "
                f"{saved.topology!r} ({len(saved.gpus)} GPUs), not of node {self._node_name!r} "
                f"with topology {self._topology.name!r} ({len(self._topology.gpus)} GPUs)"
            )
        return saved

    def _save(self, state: SimulatedNodeState | None = None) -> None:
        if self._state_path is not None:
            save_state(self._state_path, state or self._state)

    # -- helpers -------------------------------------------------------------------------

    def _gpu(self, index: int) -> SimulatedGpuState:
        if not 0 <= index < len(self._state.gpus):
            raise NotFoundError(f"no GPU with index {index} on node {self._node_name}")
        gpu = self._state.gpus[index]
        if gpu.lost:
            raise GpuLostError(f"GPU {index} ({self._uuids[index]}) is lost")
        return gpu

    def _mig_gpu(self, index: int) -> tuple[SimulatedGpuState, GpuModelSpec]:
        gpu = self._gpu(index)
        spec = self._specs[index]
        if not spec.mig_capable:
            raise NotSupportedError(f"GPU {index} ({spec.product_name}) does not support MIG")
        return gpu, spec

    def _profile(self, spec: GpuModelSpec, profile_id: int) -> MigProfile:
        for profile in spec.mig_profiles:
            if profile.profile_id == profile_id:
                return profile
        allowed = ", ".join(f"{p.profile_id} ({p.name})" for p in spec.mig_profiles)
        raise InvalidArgumentError(
            f"unknown MIG profile id {profile_id} for {spec.product_name}; allowed values: "
            f"{allowed}"
        )

    def _mig_device(self, index: int, instance: SimulatedMigInstance) -> MigDevice:
        profile = self._profile(self._specs[index], instance.profile_id)
        return MigDevice(
            parent_index=index,
            parent_uuid=self._uuids[index],
            profile_id=instance.profile_id,
            profile_name=profile.name,
            placement=MigPlacement(start=instance.start, size=instance.size),
            gpu_instance_id=instance.gpu_instance_id,
            compute_instance_id=instance.compute_instance_id,
            uuid=instance.uuid,
        )

    def _gpu_info(self, index: int) -> GpuInfo:
        spec = self._specs[index]
        gpu = self._state.gpus[index]
        uuid = self._uuids[index]
        return GpuInfo(
            index=index,
            uuid=uuid,
            product_name=spec.product_name,
            brand=spec.brand,
            architecture=spec.architecture,
            cuda_compute_capability=spec.cuda_compute_capability,
            driver_version=self._topology.driver_version,
            cuda_driver_version=self._topology.cuda_driver_version,
            memory_mib=spec.memory_mib,
            multiprocessors=spec.multiprocessors,
            pci_bus_id=self._topology.bus_id(index),
            pcie_root=self._topology.pcie_root(index),
            # /dev/nvidia<minor>: the driver numbers a machine's GPUs from 0, in bus order.
            minor_number=index,
            numa_node=self._topology.gpus[index].numa_node,
            nvlink_peers=self._peers[index],
            nvlink_domain=self._domains[uuid],
            mig_capable=spec.mig_capable,
            mig_mode=(
                MigMode(current=gpu.mig_enabled, pending=gpu.mig_enabled)
                if spec.mig_capable
                else None
            ),
            health=HealthState.UNHEALTHY if index in self._unhealthy else HealthState.HEALTHY,
        )

    # -- GpuBackend ----------------------------------------------------------------------

    def list_gpus(self) -> list[GpuInfo]:
        with self._lock:
            self.faults.check("list_gpus")
            return [self._gpu_info(i) for i, g in enumerate(self._state.gpus) if not g.lost]

    def get_mig_mode(self, index: int) -> MigMode:
        with self._lock:
            self.faults.check("get_mig_mode")
            gpu, _ = self._mig_gpu(index)
            return MigMode(current=gpu.mig_enabled, pending=gpu.mig_enabled)

    def set_mig_mode(self, index: int, enabled: bool) -> MigMode:
        with self._lock:
            self.faults.check("set_mig_mode")
            gpu, _ = self._mig_gpu(index)
            if gpu.mig_enabled != enabled:
                if gpu.mig_instances:
                    raise InUseError(
                        f"GPU {index} has {len(gpu.mig_instances)} MIG instances; destroy them "
                        "before changing MIG mode"
                    )
                if self._processes.get(index):
                    raise InUseError(f"GPU {index} has running processes")
                # Real GPUs may need a reset before the pending mode becomes current; the
                # simulator applies it at once.
                gpu.mig_enabled = enabled
                self._save()
            return MigMode(current=gpu.mig_enabled, pending=gpu.mig_enabled)

    def mig_profiles(self, index: int) -> list[MigProfile]:
        with self._lock:
            self.faults.check("mig_profiles")
            _, spec = self._mig_gpu(index)
            return list(spec.mig_profiles)

    def possible_placements(self, index: int, profile_id: int) -> list[MigPlacement]:
        with self._lock:
            self.faults.check("possible_placements")
            _, spec = self._mig_gpu(index)
            return list(self._profile(spec, profile_id).placements)

    def create_mig_device(self, index: int, profile_id: int, placement: MigPlacement) -> MigDevice:
        with self._lock:
            self.faults.check("create_mig_device")
            gpu, spec = self._mig_gpu(index)
            if not gpu.mig_enabled:
                raise NotSupportedError(f"MIG mode is disabled on GPU {index}")
            profile = self._profile(spec, profile_id)
            existing = [
                (self._profile(spec, i.profile_id), MigPlacement(start=i.start, size=i.size))
                for i in gpu.mig_instances
            ]
            check_mig_fit(profile, placement, existing)
            gi_id = gpu_instance_id_for(placement)
            gpu.creations += 1
            instance = SimulatedMigInstance(
                gpu_instance_id=gi_id,
                compute_instance_id=0,
                profile_id=profile_id,
                start=placement.start,
                size=placement.size,
                uuid=simulated_mig_uuid(self._node_name, index, gi_id, gpu.creations),
            )
            gpu.mig_instances.append(instance)
            self._save()
            return self._mig_device(index, instance)

    def destroy_mig_device(self, index: int, gpu_instance_id: int) -> None:
        with self._lock:
            self.faults.check("destroy_mig_device")
            gpu, _ = self._mig_gpu(index)
            for instance in gpu.mig_instances:
                if instance.gpu_instance_id == gpu_instance_id:
                    break
            else:
                raise NotFoundError(f"no GPU instance {gpu_instance_id} on GPU {index}")
            if any(p.gpu_instance_id == gpu_instance_id for p in self._processes.get(index, [])):
                raise InUseError(f"processes are running on GPU instance {gpu_instance_id}")
            # An MPS daemon's server holds a context on the devices it serves; NVML refuses
            # to destroy an instance in use ("In use by another client").
            for other in self._state.gpus:
                for daemon in other.mig_mps:
                    if instance.uuid in daemon.device_uuids:
                        raise InUseError(
                            f"GPU instance {gpu_instance_id} on GPU {index} ({instance.uuid}) "
                            f"is in use by the MPS daemon of {daemon.device_uuids[0]}"
                        )
            gpu.mig_instances.remove(instance)
            self._save()

    def list_mig_devices(self, index: int) -> list[MigDevice]:
        with self._lock:
            self.faults.check("list_mig_devices")
            gpu = self._gpu(index)
            ordered = sorted(gpu.mig_instances, key=lambda i: i.gpu_instance_id)
            return [self._mig_device(index, i) for i in ordered]

    def get_compute_mode(self, index: int) -> ComputeMode:
        with self._lock:
            self.faults.check("get_compute_mode")
            return self._gpu(index).compute_mode

    def set_compute_mode(self, index: int, mode: ComputeMode) -> None:
        with self._lock:
            self.faults.check("set_compute_mode")
            self._gpu(index).compute_mode = mode
            self._save()

    def set_time_slice(self, index: int, interval: TimeSliceInterval) -> None:
        with self._lock:
            self.faults.check("set_time_slice")
            self._gpu(index).time_slice = interval
            self._save()

    def _mps_folder(self) -> Path:
        if self._mps_root is None:
            root = tempfile.mkdtemp(prefix="flexgpu-sim-mps-")
            weakref.finalize(self, shutil.rmtree, root, ignore_errors=True)
            self._mps_root = Path(root)
        return self._mps_root

    def _mps_daemon(self, index: int, key: str | None = None) -> MpsDaemon:
        """The daemon of GPU ``index``, or of the MIG devices keyed by ``key`` on it."""
        uuid = key or self._uuids[index]
        folder = self._mps_folder() / uuid
        return MpsDaemon(
            gpu_index=index,
            gpu_uuid=uuid,
            pipe_dir=str(folder / "pipe"),
            log_dir=str(folder / "log"),
            shm_dir=str(folder / "shm"),
        )

    def start_mps_daemon(self, index: int) -> MpsDaemon:
        with self._lock:
            self.faults.check("start_mps_daemon")
            gpu = self._gpu(index)
            daemon = self._mps_daemon(index)
            if not gpu.mps_running:
                Path(daemon.pipe_dir).mkdir(parents=True, exist_ok=True)
                Path(daemon.log_dir).mkdir(parents=True, exist_ok=True)
                Path(daemon.shm_dir).mkdir(parents=True, exist_ok=True)
                gpu.mps_running = True
                gpu.mps_starts += 1
                gpu.compute_mode = ComputeMode.EXCLUSIVE_PROCESS
                self._save()
            return daemon

    def stop_mps_daemon(self, index: int) -> None:
        with self._lock:
            self.faults.check("stop_mps_daemon")
            gpu = self._gpu(index)
            if gpu.mps_running:
                gpu.mps_running = False
                gpu.compute_mode = ComputeMode.DEFAULT
                self._save()

    def start_mig_mps_daemon(self, spec: MigMpsDaemonSpec) -> MpsDaemon:
        with self._lock:
            self.faults.check("start_mig_mps_daemon")
            parent = self._gpu(spec.parent_index)
            daemon = self._mps_daemon(spec.parent_index, spec.key)
            if any(d.device_uuids[0] == spec.key for d in parent.mig_mps):
                return daemon  # adopted, as a restarted plugin finds it
            live = {i.uuid for gpu in self._state.gpus if not gpu.lost for i in gpu.mig_instances}
            missing = [u for u in spec.device_uuids if u not in live]
            if missing:
                raise NotFoundError(
                    f"no MIG device {', '.join(missing)} on node {self._node_name}: cannot "
                    "start its MPS daemon"
                )
            for folder in (daemon.pipe_dir, daemon.log_dir, daemon.shm_dir):
                Path(folder).mkdir(parents=True, exist_ok=True)
            # No compute mode change: the parent's other partitions are other claims'.
            parent.mig_mps.append(
                SimulatedMigMpsDaemon(
                    device_uuids=list(spec.device_uuids),
                    active_thread_percentage=spec.active_thread_percentage,
                    pinned_memory_mib=spec.pinned_by_uuid(),
                )
            )
            parent.mps_starts += 1
            self._save()
            return daemon

    def stop_mig_mps_daemon(self, parent_index: int, uuid: str) -> None:
        with self._lock:
            self.faults.check("stop_mig_mps_daemon")
            parent = self._gpu(parent_index)
            kept = [d for d in parent.mig_mps if d.device_uuids[0] != uuid]
            if len(kept) != len(parent.mig_mps):
                parent.mig_mps = kept
                self._save()

    def mps_daemons(self) -> list[MpsDaemon]:
        with self._lock:
            running = []
            for i, gpu in enumerate(self._state.gpus):
                if gpu.lost:
                    continue
                if gpu.mps_running:
                    running.append(self._mps_daemon(i))
                running += [self._mps_daemon(i, d.device_uuids[0]) for d in gpu.mig_mps]
            return running

    def wait_health_event(self, timeout_s: float) -> HealthEvent | None:
        self.faults.check("wait_health_event")
        try:
            event = self._events.get(timeout=max(timeout_s, 0.0))
        except queue.Empty:
            return None
        if event.xid is not None and xid_marks_unhealthy(event.xid):
            with self._lock:
                self._unhealthy.add(event.gpu_index)
        return event

    def process_samples(self, index: int) -> list[ProcessSample]:
        with self._lock:
            self.faults.check("process_samples")
            self._gpu(index)
            return list(self._processes.get(index, [])) + self.usage_file.processes(index)

    def gpu_usage(self, index: int) -> GpuUsage:
        with self._lock:
            self.faults.check("gpu_usage")
            gpu = self._gpu(index)
            instances = [i.gpu_instance_id for i in gpu.mig_instances]
            mig_mode = gpu.mig_enabled
        # As NVML: no device-level utilisation while MIG is on.
        device = None if mig_mode else self.usage_file.sm_utilization(index)
        return usage_from_processes(index, self.process_samples(index), instances, device)

    # -- simulation controls (not part of GpuBackend) ------------------------------------

    def mps_starts(self, index: int) -> int:
        """How often an MPS daemon was started on the GPU, its own or one of its MIG devices'
        (adoption does not count)."""
        with self._lock:
            return self._gpu(index).mps_starts

    def mig_mps_daemon(self, uuid: str) -> SimulatedMigMpsDaemon | None:
        """What the MIG device daemon keyed by ``uuid`` was started with; ``None`` if none
        runs."""
        with self._lock:
            for gpu in self._state.gpus:
                for daemon in gpu.mig_mps:
                    if daemon.device_uuids[0] == uuid:
                        return daemon.model_copy(deep=True)
            return None

    def time_slice(self, index: int) -> TimeSliceInterval:
        """The time slice last set; NVML offers no way to read it back, the simulator does."""
        with self._lock:
            return self._gpu(index).time_slice

    def inject_xid(self, index: int, xid: int, gpu_instance_id: int | None = None) -> None:
        """Raise an Xid on a GPU, delivered through :meth:`wait_health_event`."""
        with self._lock:
            self._gpu(index)
            compute_instance_id = 0 if gpu_instance_id is not None else None
            self._events.put(
                HealthEvent(
                    kind=HealthEventKind.XID,
                    gpu_index=index,
                    gpu_uuid=self._uuids[index],
                    xid=xid,
                    gpu_instance_id=gpu_instance_id,
                    compute_instance_id=compute_instance_id,
                )
            )

    def lose_gpu(self, index: int) -> None:
        """The GPU falls off the bus: it vanishes from listings and every call on it fails."""
        with self._lock:
            self._gpu(index).lost = True
            self._save()
            self._events.put(
                HealthEvent(
                    kind=HealthEventKind.GPU_LOST, gpu_index=index, gpu_uuid=self._uuids[index]
                )
            )

    def restore_gpu(self, index: int) -> None:
        """Undo :meth:`lose_gpu` and any Xid-induced unhealthiness, as a node reboot would."""
        with self._lock:
            if not 0 <= index < len(self._state.gpus):
                raise NotFoundError(f"no GPU with index {index} on node {self._node_name}")
            self._state.gpus[index].lost = False
            self._unhealthy.discard(index)
            self._save()

    def set_processes(self, index: int, samples: Sequence[ProcessSample]) -> None:
        """Pretend these processes run on the GPU (they block MIG changes, as on hardware)."""
        with self._lock:
            self._gpu(index)
            self._processes[index] = list(samples)
