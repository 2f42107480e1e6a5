"""MPS control daemons as pods of their own, one per GPU, owned by the plugin's DaemonSet.

A daemon inside the plugin's container would share its cgroup and memory limit and end with
every plugin restart or upgrade, taking the MPS server of every client with it. Here each
daemon is a pod the plugin creates on its node (``spec.nodeName``, no scheduler), owned by the
plugin's DaemonSet (removed by ``helm uninstall``, never with a plugin pod), of the one shape
the chart's admission policy admits (``mps_pod_spec``), with its own memory request
and limit, its pipe, log and shared-memory folders on a host path under the MPS root, and the
MPS programs from the driver root. A restarted plugin finds the pods and adopts them; the last
share's unprepare deletes the GPU's pod; a daemon that ended while shares still use it is
started again and a Warning Event on the Node says so.

The pod runs ``nvidia-cuda-mps-control -f`` (foreground) from the driver root, with only the
driver's NVIDIA libraries on ``LD_LIBRARY_PATH`` (a folder of links the plugin keeps under the
MPS root), so the host's other libraries never mix with the image's.

A claim's MIG devices shared with MPS get a pod of their own (``start_mig``), named after the
first device's UUID and seeing only the claim's MIG devices (``CUDA_VISIBLE_DEVICES``); the
parent GPU's compute mode is left alone. Once the daemon serves, the plugin tells it the
claim's limits on its control pipe (``set_default_*``, as NVIDIA's daemon template does); the
pod's annotations keep what it was started with, so a daemon that ended is started again the
same way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flexgpu.driver.backend import GpuBackend
from flexgpu.driver.backend_errors import GpuBackendError
from flexgpu.driver.backoff import Backoff
from flexgpu.driver.gpu_model import ComputeMode, MpsDaemon
from flexgpu.driver.loop import Loop
from flexgpu.driver.mps_daemon_spec import MigMpsDaemonSpec, serves_mig
from flexgpu.driver.mps_folders import (
    control_pipe_problem,
    empty_daemon_folders,
    prepare_daemon_folders,
)
from flexgpu.kubelet_plugin.agents.mps_pod_spec import (
    COMPONENT,
    COMPONENT_LABEL,
    CONTROL,
    DEFAULT_PRIORITY_CLASS,
    DEFAULT_RESOURCES,
    GPU_INDEX_LABEL,
    GPU_UUID_ANNOTATION,
    MpsPodShape,
    pod_name,
)
from flexgpu.kubelet_plugin.agents.mps_pod_status import (
    TERMINATED,
    ended_how,
    gpu_index_of,
    mig_spec_of,
    pod_phase,
    pod_serves_mig,
)
from flexgpu.kubelet_plugin.api.kube_api import ApiError, KubeApi, path_of
from flexgpu.kubelet_plugin.api.node_events import NodeEventSink
from flexgpu.kubelet_plugin.api.watched_objects import WatchedObjects
from flexgpu.kubelet_plugin.devices.driver_edits import library_paths

log = logging.getLogger(__name__)


class MpsDaemonPods:
    def __init__(
        self,
        api: KubeApi,
        backend: GpuBackend,
        *,
        node_name: str,
        namespace: str,
        image: str,
        mps_root: Path,
        driver_root: Path,
        host_driver_root: Path | None = None,
        libraries: Sequence[str] = (),
        events: NodeEventSink | None = None,
        resources: Mapping[str, Any] = DEFAULT_RESOURCES,
        priority_class: str = DEFAULT_PRIORITY_CLASS,
        ready_timeout_s: float = 60.0,
        run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
        owner_pod: str | None = None,
        owner: Mapping[str, str] | None = None,
    ) -> None:
        self._api = api
        self._backend = backend
        self._node = node_name
        self._namespace = namespace
        self._image = image
        self._root = mps_root
        # The pod sees the host's driver root where the plugin sees it, so links and the
        # program's path are the same in both.
        self._driver_root = driver_root
        self._host_driver_root = host_driver_root or driver_root
        self._libraries = list(libraries)
        self._events = events
        self._resources = dict(resources)
        self._priority_class = priority_class
        self._ready_timeout_s = ready_timeout_s
        # The daemons' owner: given, or the controller (DaemonSet) of the plugin's own pod
        # (``owner_pod``), else the Node; looked up once (mps_pod_spec.py says why).
        self._owner = dict(owner) if owner is not None else None
        self._owner_pod = owner_pod
        self._loop: Loop | None = None
        # This node's daemon pods, listed once (resourceVersion=0) and then watched; filled
        # once watch() starts it. Until then (start-up) _pods() lists.
        self._pods_copy = WatchedObjects(
            api,
            path_of("api", "v1", "namespaces", namespace, "pods"),
            query=self._pods_query(),
            name="mps-daemon-pods",
            on_change=self._pods_changed,
        )
        # Runs the driver root's control program as a client of a daemon (its limits).
        self._run = run

    # -- MpsDaemons ----------------------------------------------------------------------
    def start(self, index: int) -> MpsDaemon:
        daemon = self._daemon(index, self._uuid(index))
        if self._create(daemon, lambda: self._pod(daemon), ComputeMode.EXCLUSIVE_PROCESS):
            log.info(
                "MPS daemon pod %s/%s created for GPU %d",
                self._namespace,
                pod_name(daemon.gpu_uuid),
                index,
            )
        return daemon

    def start_mig(self, spec: MigMpsDaemonSpec) -> MpsDaemon:
        daemon = self._daemon(spec.parent_index, spec.key)
        # No compute mode: the parent GPU's other partitions belong to other claims.
        if self._create(daemon, lambda: self._pod(daemon, spec), None):
            log.info(
                "MPS daemon pod %s/%s created for MIG devices %s",
                self._namespace,
                pod_name(spec.key),
                spec.visible_devices,
            )
        # Told again to an adopted daemon too: setting a default twice changes nothing.
        self._configure(daemon, spec)
        return daemon

    def _create(
        self, daemon: MpsDaemon, pod: Callable[[], dict[str, Any]], mode: ComputeMode | None
    ) -> bool:
        """Starts the daemon's pod unless it runs (then it is adopted), and waits until it
        serves; whether a pod was created."""
        existing = self._get(pod_name(daemon.gpu_uuid))
        if existing is not None and pod_phase(existing) not in TERMINATED:
            self._wait_ready(daemon)
            return False
        if existing is not None:
            self._restarted(daemon, existing)
        # A control pipe left by a daemon that died would look like a live one, and what
        # clients left in the folders they mount is never served or trusted (mps_folders.py).
        prepare_daemon_folders(daemon.pipe_dir, daemon.log_dir, daemon.shm_dir)
        if mode is not None:
            self._backend.set_compute_mode(daemon.gpu_index, mode)
        self._api.request(
            "POST",
            path_of("api", "v1", "namespaces", self._namespace, "pods"),
            body=pod(),
        )
        self._wait_ready(daemon)
        return True

    def _configure(self, daemon: MpsDaemon, spec: MigMpsDaemonSpec) -> None:
        """Sends the claim's limits to the daemon, one command per call as NVIDIA's template
        does, through the driver root's control program used as a client."""
        env = {
            "CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": daemon.log_dir,
            "LD_LIBRARY_PATH": os.fspath(self._library_dir()),
        }
        program = os.fspath(self._driver_root / CONTROL)
        commands = spec.control_commands()
        problem = control_pipe_problem(daemon.pipe_dir) if commands else None
        if problem is not None:
            raise GpuBackendError(f"not telling the MPS daemon of {spec.key} its limits: {problem}")
        for command in commands:
            try:
                done = self._run(
                    [program],
                    input=command + "\n",
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=30,
                    check=False,
                )
            except (OSError, subprocess.SubprocessError) as err:
                raise GpuBackendError(
                    f"cannot tell the MPS daemon of {spec.key} {command!r}: {err}"
                ) from None
            if done.returncode != 0:
                output = (done.stderr or done.stdout or "").strip()
                raise GpuBackendError(
                    f"MPS daemon of {spec.key} refused {command!r} (exit code "
                    f"{done.returncode}): {output}; its log is in {daemon.log_dir}"
                )

    def stop(self, index: int) -> None:
        uuid = self._uuid(index)
        self._remove(pod_name(uuid))
        self._emptied(self._daemon(index, uuid))
        self._backend.set_compute_mode(index, ComputeMode.DEFAULT)

    def stop_mig(self, parent_index: int, uuid: str) -> None:
        self._remove(pod_name(uuid))
        self._emptied(self._daemon(parent_index, uuid))

    def _emptied(self, daemon: MpsDaemon) -> None:
        """Its last claim gone, nothing of its clients stays for the GPU's next tenant; once
        the pod is gone (a daemon still running keeps its files: the unprepare fails and is
        tried again, its record kept)."""
        if self._get(pod_name(daemon.gpu_uuid)) is not None:
            raise GpuBackendError(
                f"MPS daemon pod {self._namespace}/{pod_name(daemon.gpu_uuid)} is still there "
                f"{self._ready_timeout_s:.0f} s after its delete"
            )
        empty_daemon_folders(daemon.pipe_dir, daemon.shm_dir)

    def _remove(self, name: str) -> None:
        with contextlib.suppress(ApiError):
            self._delete(name)
        deadline = time.monotonic() + self._ready_timeout_s
        while self._get(name) is not None and time.monotonic() < deadline:
            time.sleep(0.1)

    def running(self) -> list[MpsDaemon]:
        daemons = []
        for pod in self._pods():
            if pod_phase(pod) in TERMINATED:
                continue
            meta = pod["metadata"]
            uuid = meta.get("annotations", {}).get(GPU_UUID_ANNOTATION, "")
            index = meta.get("labels", {}).get(GPU_INDEX_LABEL, "")
            if uuid and index.isdigit():
                daemons.append(self._daemon(int(index), uuid))
        return daemons

    # -- crash watch ---------------------------------------------------------------------
    def watch(
        self,
        in_use: Callable[[], set[int]],
        locked: Callable[[int], contextlib.AbstractContextManager[None]],
        interval_s: float = 5.0,
    ) -> None:
        """Watches this node's daemon pods; at each change, and every ``interval_s``, starts
        again the daemon of each GPU that shares still use whose pod has ended, under the
        GPU's lock. The rounds read the watched copy: they cost no API request."""

        def step() -> None:
            if not self._pods_copy.synced:
                return  # the API server is away: the copy's own retries wait for it
            self.restart_ended(in_use, locked)

        # A failed check (API away) is logged by the loop and tried again about one
        # interval later, as an ordinary round would be.
        self._loop = Loop(
            "mps-daemon-watch",
            step,
            interval_s,
            backoff=Backoff(interval_s, interval_s),
            first_run_s=interval_s,
        )
        self._loop.start()
        self._pods_copy.start()

    def _pods_changed(self) -> None:
        if self._loop is not None:
            self._loop.poke()

    def restart_ended(
        self,
        in_use: Callable[[], set[int]],
        locked: Callable[[int], contextlib.AbstractContextManager[None]],
    ) -> list[int]:
        """Starts again the ended daemons that claims use: a whole GPU's while a share on it
        is prepared, a MIG device daemon while its devices still exist (its claim's
        unprepare deletes the pod under the same lock, so a pod still there is still its
        claim's). Returns the GPU indices (for MIG, the parents) of what was started."""
        ended = [p for p in self._pods() if pod_phase(p) in TERMINATED]
        whole = {gpu_index_of(p) for p in ended if not pod_serves_mig(p)}
        restarted = []
        for index in sorted(whole & in_use()):
            with locked(index):
                # Its last share may have gone meanwhile; and a GPU in MIG mode is in use for
                # its MIG devices' daemons only: its own would take it exclusive.
                if index in in_use() and not self._in_mig_mode(index):
                    self.start(index)
                    restarted.append(index)
        for pod in ended:
            spec = mig_spec_of(pod)
            if spec is None or spec.parent_index not in in_use():
                continue
            with locked(spec.parent_index):
                if self._restart_mig(pod["metadata"]["name"], spec):
                    restarted.append(spec.parent_index)
        return restarted

    def _in_mig_mode(self, index: int) -> bool:
        try:
            return self._backend.get_mig_mode(index).current
        except GpuBackendError:  # no MIG on this GPU (NotSupportedError), or it is gone
            return False

    def _restart_mig(self, name: str, spec: MigMpsDaemonSpec) -> bool:
        current = self._get(name)
        if current is None or pod_phase(current) not in TERMINATED:
            return False  # unprepared meanwhile, or started again already
        live = {
            m.uuid
            for gpu in self._backend.list_gpus()
            for m in self._backend.list_mig_devices(gpu.index)
            if m.uuid is not None
        }
        if not set(spec.device_uuids) <= live:
            # Its partitions are gone: a leftover of a claim whose pod delete failed.
            self._remove(name)
            return False
        self.start_mig(spec)
        return True

    def close(self) -> None:
        self._pods_copy.stop()
        if self._loop is not None:
            self._loop.stop(timeout_s=10)

    # -- helpers -------------------------------------------------------------------------
    def _restarted(self, daemon: MpsDaemon, pod: Mapping[str, Any]) -> None:
        why = ended_how(pod)
        what = (
            f"MIG device {daemon.gpu_uuid} on GPU {daemon.gpu_index}"
            if serves_mig(daemon)
            else f"GPU {daemon.gpu_index} ({daemon.gpu_uuid})"
        )
        message = (
            f"MPS control daemon of {what} ended ({why}); "
            f"started it again as pod {self._namespace}/{pod['metadata']['name']}. Its clients "
            "must reconnect."
        )
        log.warning("%s", message)
        if self._events is not None:
            self._events("MpsDaemonRestarted", message)
        self._delete(pod["metadata"]["name"])
        deadline = time.monotonic() + self._ready_timeout_s
        while self._get(pod["metadata"]["name"]) is not None and time.monotonic() < deadline:
            time.sleep(0.1)

    def _wait_ready(self, daemon: MpsDaemon) -> None:
        """Until the daemon serves its control pipe; a pod that ends first fails the start."""
        name = pod_name(daemon.gpu_uuid)
        control = Path(daemon.pipe_dir) / "control"
        deadline = time.monotonic() + self._ready_timeout_s
        while time.monotonic() < deadline:
            pod = self._get(name)
            if pod is None or pod_phase(pod) in TERMINATED:
                how = ended_how(pod) if pod else "deleted"
                raise GpuBackendError(
                    f"MPS daemon pod {self._namespace}/{name} for GPU {daemon.gpu_index} ended "
                    f"before serving ({how}); its log is in {daemon.log_dir}"
                )
            if pod_phase(pod) == "Running" and control.exists():
                return
            time.sleep(0.1)
        raise GpuBackendError(
            f"MPS daemon pod {self._namespace}/{name} for GPU {daemon.gpu_index} is not serving "
            f"{control} after {self._ready_timeout_s:.0f} s"
        )

    def _uuid(self, index: int) -> str:
        for gpu in self._backend.list_gpus():
            if gpu.index == index:
                return gpu.uuid
        raise GpuBackendError(f"GPU {index} is not on node {self._node}")

    def _daemon(self, index: int, uuid: str) -> MpsDaemon:
        folder = self._root / uuid
        return MpsDaemon(
            gpu_index=index,
            gpu_uuid=uuid,
            pipe_dir=os.fspath(folder / "pipe"),
            log_dir=os.fspath(folder / "log"),
            shm_dir=os.fspath(folder / "shm"),
        )

    def follow_driver(self, edits: Mapping[str, Any]) -> None:
        """A new driver's edits (claims/driver_change.py): daemon pods started from now on
        link its libraries."""
        self._libraries = library_paths(self._driver_root, edits)

    def _library_dir(self) -> Path:
        """Links to the driver's NVIDIA libraries only (the generator's library mounts)."""
        folder = self._root / "lib"
        folder.mkdir(parents=True, exist_ok=True)
        for library in self._libraries:
            link = folder / Path(library).name
            if not link.is_symlink() or os.readlink(link) != library:
                temp = folder / f".{link.name}.tmp"
                with contextlib.suppress(FileNotFoundError):
                    temp.unlink()
                temp.symlink_to(library)
                temp.replace(link)
        return folder

    def _pod(self, daemon: MpsDaemon, mig: MigMpsDaemonSpec | None = None) -> dict[str, Any]:
        shape = MpsPodShape(
            node=self._node,
            namespace=self._namespace,
            image=self._image,
            mps_root=self._root,
            driver_root=self._driver_root,
            host_driver_root=self._host_driver_root,
            resources=self._resources,
            priority_class=self._priority_class,
        )
        return shape.render(daemon, self._owner_of(), self._library_dir(), mig)

    def _owner_of(self) -> dict[str, str]:
        if self._owner is None:
            self._owner = self._pod_controller() or self._node_owner()
        return self._owner

    def _pod_controller(self) -> dict[str, str] | None:
        """The controller of the plugin's own pod (the chart's DaemonSet), if it is one."""
        if self._owner_pod is None:
            return None
        pod = self._get(self._owner_pod)
        for ref in (pod or {}).get("metadata", {}).get("ownerReferences") or []:
            if ref.get("controller"):
                keys = ("apiVersion", "kind", "name", "uid")
                return {k: str(ref[k]) for k in keys}
        return None

    def _node_owner(self) -> dict[str, str]:
        # A list by name: what the plugin's RBAC already allows on nodes.
        listed = self._api.get(
            path_of("api", "v1", "nodes"),
            query={"fieldSelector": f"metadata.name={self._node}"},
        )
        (node,) = listed.get("items", [])
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "name": self._node,
            "uid": node["metadata"]["uid"],
        }

    def _get(self, name: str) -> dict[str, Any] | None:
        try:
            return self._api.get(path_of("api", "v1", "namespaces", self._namespace, "pods", name))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def _delete(self, name: str) -> None:
        try:
            self._api.request(
                "DELETE",
                path_of("api", "v1", "namespaces", self._namespace, "pods", name),
                body={"gracePeriodSeconds": 5},
            )
        except ApiError as err:
            if err.status != 404:
                raise

    def _pods(self) -> Iterable[dict[str, Any]]:
        if self._pods_copy.synced:
            return self._pods_copy.items()
        listed = self._api.get(
            path_of("api", "v1", "namespaces", self._namespace, "pods"),
            query={**self._pods_query(), "resourceVersion": "0"},
        )
        return list(listed.get("items", []))

    def _pods_query(self) -> dict[str, str]:
        return {
            "labelSelector": f"{COMPONENT_LABEL}={COMPONENT}",
            "fieldSelector": f"spec.nodeName={self._node}",
        }
