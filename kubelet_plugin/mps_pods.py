"""MPS control daemons as pods of their own, one per GPU, owned by the Node.

A daemon inside the plugin's container would share its cgroup and memory limit and end with
every plugin restart or upgrade, taking the MPS server of every client with it. Here each
daemon is a pod the plugin creates on its node (``spec.nodeName``, no scheduler), owned by the
Node object (garbage-collected with it, never with a plugin pod), with its own memory request
and limit, its pipe, log and shared-memory folders on a host path under the MPS root, and the
MPS programs from the driver root. A restarted plugin finds the pods and adopts them; the last
share's unprepare deletes the GPU's pod; a daemon that ended while shares still use it is
started again and a Warning Event on the Node says so.

The pod runs ``nvidia-cuda-mps-control -f`` (foreground) from the driver root, with only the
driver's NVIDIA libraries on ``LD_LIBRARY_PATH`` (a folder of links the plugin keeps under the
MPS root), so the host's other libraries never mix with the image's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flexgpu.driver.backend import GpuBackend
from flexgpu.driver.backend_errors import GpuBackendError
from flexgpu.driver.backoff import Backoff
from flexgpu.driver.gpu_model import ComputeMode, MpsDaemon
from flexgpu.driver.loop import Loop
from flexgpu.kubelet_plugin.kube_api import ApiError, KubeApi, path_of
from flexgpu.kubelet_plugin.node_events import NodeEventSink

log = logging.getLogger(__name__)

COMPONENT_LABEL = "app.kubernetes.io/component"
COMPONENT = "mps-control-daemon"
GPU_INDEX_LABEL = "gpu.flexgpu.dev/gpu-index"
GPU_UUID_ANNOTATION = "gpu.flexgpu.dev/gpu-uuid"
CONTROL = "usr/bin/nvidia-cuda-mps-control"
TERMINATED = frozenset({"Succeeded", "Failed"})
DEFAULT_RESOURCES: Mapping[str, Any] = {
    "requests": {"cpu": "10m", "memory": "32Mi"},
    "limits": {"memory": "256Mi"},
}


def pod_name(gpu_uuid: str) -> str:
    return f"flexgpu-mps-{gpu_uuid.lower()}"[:63].rstrip("-")


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
        ready_timeout_s: float = 60.0,
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
        self._ready_timeout_s = ready_timeout_s
        self._node_uid: str | None = None
        self._loop: Loop | None = None

    # -- MpsDaemons ----------------------------------------------------------------------
    def start(self, index: int) -> MpsDaemon:
        uuid = self._uuid(index)
        daemon = self._daemon(index, uuid)
        pod = self._get(pod_name(uuid))
        if pod is not None and _phase(pod) not in TERMINATED:
            self._wait_ready(daemon)
            return daemon
        if pod is not None:
            self._restarted(daemon, pod)
        for folder in (daemon.pipe_dir, daemon.log_dir, daemon.shm_dir):
            Path(folder).mkdir(parents=True, exist_ok=True)
        # A control pipe left by a daemon that died would look like a live one.
        with contextlib.suppress(FileNotFoundError):
            (Path(daemon.pipe_dir) / "control").unlink()
        self._backend.set_compute_mode(index, ComputeMode.EXCLUSIVE_PROCESS)
        self._api.request(
            "POST",
            path_of("api", "v1", "namespaces", self._namespace, "pods"),
            body=self._pod(daemon),
        )
        log.info("MPS daemon pod %s/%s created for GPU %d", self._namespace, pod_name(uuid), index)
        self._wait_ready(daemon)
        return daemon

    def stop(self, index: int) -> None:
        uuid = self._uuid(index)
        name = pod_name(uuid)
        with contextlib.suppress(ApiError):
            self._delete(name)
        deadline = time.monotonic() + self._ready_timeout_s
        while self._get(name) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        self._backend.set_compute_mode(index, ComputeMode.DEFAULT)

    def running(self) -> list[MpsDaemon]:
        daemons = []
        for pod in self._pods():
            if _phase(pod) in TERMINATED:
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
        """Every ``interval_s``, starts again the daemon of each GPU that shares still use
        whose pod has ended, under the GPU's lock."""

        def step() -> None:
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

    def restart_ended(
        self,
        in_use: Callable[[], set[int]],
        locked: Callable[[int], contextlib.AbstractContextManager[None]],
    ) -> list[int]:
        ended = {
            int(p["metadata"]["labels"][GPU_INDEX_LABEL])
            for p in self._pods()
            if _phase(p) in TERMINATED
        }
        restarted = []
        for index in sorted(ended & in_use()):
            with locked(index):
                if index in in_use():  # its last share may have gone meanwhile
                    self.start(index)
                    restarted.append(index)
        return restarted

    def close(self) -> None:
        if self._loop is not None:
            self._loop.stop(timeout_s=10)

    # -- helpers -------------------------------------------------------------------------
    def _restarted(self, daemon: MpsDaemon, pod: Mapping[str, Any]) -> None:
        why = _ended_how(pod)
        message = (
            f"MPS control daemon of GPU {daemon.gpu_index} ({daemon.gpu_uuid}) ended ({why}); "
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
            if pod is None or _phase(pod) in TERMINATED:
                how = _ended_how(pod) if pod else "deleted"
                raise GpuBackendError(
                    f"MPS daemon pod {self._namespace}/{name} for GPU {daemon.gpu_index} ended "
                    f"before serving ({how}); its log is in {daemon.log_dir}"
                )
            if _phase(pod) == "Running" and control.exists():
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

    def _pod(self, daemon: MpsDaemon) -> dict[str, Any]:
        mps = os.fspath(self._root)
        env = {
            "CUDA_VISIBLE_DEVICES": daemon.gpu_uuid,
            "CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": daemon.log_dir,
            "LD_LIBRARY_PATH": os.fspath(self._library_dir()),
            "NVIDIA_VISIBLE_DEVICES": "void",
        }
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name(daemon.gpu_uuid),
                "namespace": self._namespace,
                "labels": {
                    COMPONENT_LABEL: COMPONENT,
                    GPU_INDEX_LABEL: str(daemon.gpu_index),
                },
                "annotations": {GPU_UUID_ANNOTATION: daemon.gpu_uuid},
                "ownerReferences": [
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "name": self._node,
                        "uid": self._node_uid_of(),
                    }
                ],
            },
            "spec": {
                "nodeName": self._node,
                # The plugin starts it again, and says so, while shares use it.
                "restartPolicy": "Never",
                "hostPID": True,
                "priorityClassName": "system-node-critical",
                "tolerations": [{"operator": "Exists"}],
                "terminationGracePeriodSeconds": 5,
                "containers": [
                    {
                        "name": "mps-control",
                        "image": self._image,
                        "command": [os.fspath(self._driver_root / CONTROL), "-f"],
                        "env": [{"name": k, "value": v} for k, v in env.items()],
                        "securityContext": {"privileged": True},
                        "resources": self._resources,
                        "volumeMounts": [
                            {"name": "mps", "mountPath": mps},
                            {"name": "shm", "mountPath": "/dev/shm"},
                            {
                                "name": "driver",
                                "mountPath": os.fspath(self._driver_root),
                                "readOnly": True,
                            },
                        ],
                    }
                ],
                "volumes": [
                    {"name": "mps", "hostPath": {"path": mps, "type": "DirectoryOrCreate"}},
                    {"name": "shm", "hostPath": {"path": daemon.shm_dir, "type": "Directory"}},
                    {
                        "name": "driver",
                        "hostPath": {
                            "path": os.fspath(self._host_driver_root),
                            "type": "Directory",
                        },
                    },
                ],
            },
        }

    def _node_uid_of(self) -> str:
        if self._node_uid is None:
            # A list by name: what the plugin's RBAC already allows on nodes.
            listed = self._api.get(
                path_of("api", "v1", "nodes"),
                query={"fieldSelector": f"metadata.name={self._node}"},
            )
            (node,) = listed.get("items", [])
            self._node_uid = str(node["metadata"]["uid"])
        return self._node_uid

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
        listed = self._api.get(
            path_of("api", "v1", "namespaces", self._namespace, "pods"),
            query={
                "labelSelector": f"{COMPONENT_LABEL}={COMPONENT}",
                "fieldSelector": f"spec.nodeName={self._node}",
            },
        )
        return list(listed.get("items", []))


def _phase(pod: Mapping[str, Any]) -> str:
    return str(pod.get("status", {}).get("phase", "Pending"))


def _ended_how(pod: Mapping[str, Any]) -> str:
    for status in pod.get("status", {}).get("containerStatuses", []) or []:
        done = (status.get("state") or {}).get("terminated")
        if done:
            return f"exit code {done.get('exitCode')}, {done.get('reason', 'no reason given')}"
    return f"pod phase {_phase(pod)}"
