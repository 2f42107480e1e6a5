"""The one shape of an MPS control daemon pod. The chart's admission policy
(charts/flexgpu/templates/mps-pods-admission-policy.yaml) admits from the plugin's token only
pods of exactly this shape, with every field below pinned and every other field absent, so
keep the two in step (tests/integration/test_mps_pod_admission.py proves the plugin's own pod
is admitted and each changed shape is not).

What varies per daemon is checked there against the pod's own GPU UUID (its annotation):
the name, the folders (``<mpsRoot>/<uuid>/{pipe,log,shm}``) and ``CUDA_VISIBLE_DEVICES``.
The pod is owned by the plugin's DaemonSet, so ``helm uninstall`` removes the daemons while a
plugin upgrade (the same DaemonSet) leaves them running; a plugin that is no chart pod (a
test harness) makes it the Node's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flexgpu.driver.gpu_model import MpsDaemon
from flexgpu.driver.mps_daemon_spec import MigMpsDaemonSpec

__all__ = [
    "COMPONENT",
    "COMPONENT_LABEL",
    "CONTAINER",
    "CONTROL",
    "DEFAULT_RESOURCES",
    "GPU_INDEX_LABEL",
    "GPU_UUID_ANNOTATION",
    "MIG_SPEC_ANNOTATION",
    "MpsPodShape",
    "pod_name",
    "spec_text",
]

COMPONENT_LABEL = "app.kubernetes.io/component"
COMPONENT = "mps-control-daemon"
GPU_INDEX_LABEL = "gpu.flexgpu.dev/gpu-index"
GPU_UUID_ANNOTATION = "gpu.flexgpu.dev/gpu-uuid"
# A MIG device daemon's devices and limits (JSON), to start it again as it was.
MIG_SPEC_ANNOTATION = "gpu.flexgpu.dev/mig-mps"
CONTROL = "usr/bin/nvidia-cuda-mps-control"
CONTAINER = "mps-control"
DEFAULT_PRIORITY_CLASS = "system-node-critical"
DEFAULT_RESOURCES: Mapping[str, Any] = {
    "requests": {"cpu": "10m", "memory": "32Mi"},
    "limits": {"memory": "256Mi"},
}


def pod_name(gpu_uuid: str) -> str:
    return f"flexgpu-mps-{gpu_uuid.lower()}"[:63].rstrip("-")


@dataclass(frozen=True)
class MpsPodShape:
    """What every daemon pod of one plugin shares."""

    node: str
    namespace: str
    image: str
    mps_root: Path
    # The host's driver root, mounted where the plugin sees it (``driver_root``), so links
    # and the program's path are the same in both.
    driver_root: Path
    host_driver_root: Path
    resources: Mapping[str, Any] = field(default_factory=lambda: dict(DEFAULT_RESOURCES))
    priority_class: str = DEFAULT_PRIORITY_CLASS

    def render(
        self,
        daemon: MpsDaemon,
        owner: Mapping[str, str],
        library_dir: Path,
        mig: MigMpsDaemonSpec | None = None,
    ) -> dict[str, Any]:
        mps = os.fspath(self.mps_root)
        annotations = {GPU_UUID_ANNOTATION: daemon.gpu_uuid}
        if mig is not None:
            annotations[MIG_SPEC_ANNOTATION] = spec_text(mig)
        env = {
            "CUDA_VISIBLE_DEVICES": mig.visible_devices if mig else daemon.gpu_uuid,
            "CUDA_MPS_PIPE_DIRECTORY": daemon.pipe_dir,
            "CUDA_MPS_LOG_DIRECTORY": daemon.log_dir,
            "LD_LIBRARY_PATH": os.fspath(library_dir),
            "NVIDIA_VISIBLE_DEVICES": "void",
        }
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name(daemon.gpu_uuid),
                "namespace": self.namespace,
                "labels": {COMPONENT_LABEL: COMPONENT, GPU_INDEX_LABEL: str(daemon.gpu_index)},
                "annotations": annotations,
                "ownerReferences": [dict(owner)],
            },
            "spec": {
                "nodeName": self.node,
                # The plugin starts it again, and says so, while shares use it.
                "restartPolicy": "Never",
                "hostPID": True,
                "priorityClassName": self.priority_class,
                "tolerations": [{"operator": "Exists"}],
                "terminationGracePeriodSeconds": 5,
                # The daemon talks to no API server: no token, no service variables.
                "automountServiceAccountToken": False,
                "enableServiceLinks": False,
                "containers": [
                    {
                        "name": CONTAINER,
                        "image": self.image,
                        "command": [os.fspath(self.driver_root / CONTROL), "-f"],
                        "env": [{"name": k, "value": v} for k, v in env.items()],
                        "securityContext": {"privileged": True},
                        "resources": dict(self.resources),
                        "volumeMounts": [
                            {"name": "mps", "mountPath": mps},
                            {"name": "shm", "mountPath": "/dev/shm"},
                            {
                                "name": "driver",
                                "mountPath": os.fspath(self.driver_root),
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
                            "path": os.fspath(self.host_driver_root),
                            "type": "Directory",
                        },
                    },
                ],
            },
        }


def spec_text(spec: MigMpsDaemonSpec) -> str:
    return json.dumps(
        {
            "parentIndex": spec.parent_index,
            "devices": list(spec.device_uuids),
            "activeThreadPercentage": spec.active_thread_percentage,
            "pinnedMemoryMiB": list(spec.pinned_memory_mib),
        },
        sort_keys=True,
    )
