"""One demo GPU node as a real node (tools/node: upstream kubelet, containerd and runc, a
simulated driver root, the plugin as the chart's DaemonSet pod). Its pods run the workload
image, which prints from inside what the runtime gave it. The other nodes stay kubelet
harness nodes: the catalog's scenarios run there, the real node runs pods of its own.

When the machine or the build lacks something the real node needs, the demo says what in one
line and goes on without it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from kubernetes import client

from demo.catalog import NAMESPACE, Seen
from tools import buildcache
from tools.cluster.control_plane import ControlPlane
from tools.node import chart, preflight, report
from tools.node.node import RealNode

NAME = "gpu-node-real"
TOPOLOGY = "h200-4"
GPUS = 4
KUBELET_MINOR = 37
# Keeps the catalog's pods off the real node (their images exist nowhere); the chart's
# plugin tolerates this key, and the real node's own pods tolerate it too.
TAINT = {"key": "flexgpu.dev/gpu", "value": "demo", "effect": "NoSchedule"}
# Written by the supervisor for the `make demo` process: the node's log folder and image, or
# why there is no real node.
STATE_FILE = "real-node.json"
# (pod, GPUs in its claim)
PODS: tuple[tuple[str, int], ...] = (("real-one-gpu", 1), ("real-two-gpus", 2))


def binaries_built() -> bool:
    """Whether `make node` has built the node's binaries, asked of the build cache without
    starting a build: a cold one takes half an hour."""
    return buildcache.lookup("node") is not None


def missing(cluster: ControlPlane) -> str:
    """What keeps the real node from starting here, in one line; empty when nothing does."""
    found = preflight.problems()
    match = re.search(r"v1\.(\d+)\.", cluster.version)
    if match and int(match.group(1)) < KUBELET_MINOR:
        found.append(f"the control plane is {cluster.version.split()[-1]}, older than its kubelet")
    if not found and not binaries_built():
        found.append("its binaries are not built (run `make node`)")
    return "; ".join(found)


def chart_values(node: RealNode, image: str) -> list[str]:
    # Every H200 of the topology is in MIG mode; a GPU in MIG mode without a mode of its own
    # serves only the MIG devices it has (none here), so the plugin partitions them on
    # demand, which also serves whole GPUs (the simulated GPUs switch without a reset).
    dynamic = ["--set-string", "kubeletPlugin.dynamicMigGpus=all"]
    return chart.plugin_values(node, image, TOPOLOGY) + dynamic


def taint(node: RealNode) -> None:
    core: Any = client.CoreV1Api(node.api)
    current = core.read_node(node.name).spec.taints or []
    if not any(t.key == TAINT["key"] for t in current):
        kept = [{"key": t.key, "value": t.value, "effect": t.effect} for t in current]
        core.patch_node(node.name, {"spec": {"taints": [*kept, TAINT]}})


def write_state(workdir: Path, *, node: RealNode | None, reason: str = "") -> None:
    state = (
        {"podLogs": str(node.layout.pod_logs), "image": node.images["workload"].name}
        if node is not None
        else {"skipped": reason}
    )
    (workdir / STATE_FILE).write_text(json.dumps(state))


def read_state(workdir: Path) -> dict[str, str]:
    path = workdir / STATE_FILE
    return dict(json.loads(path.read_text())) if path.exists() else {"skipped": "not started"}


def manifests(image: str) -> list[dict[str, Any]]:
    """A claim template and a pod pinned to the real node for each of PODS."""
    docs: list[dict[str, Any]] = []
    for pod, count in PODS:
        docs.append(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": pod},
                "spec": {
                    "spec": {
                        "devices": {
                            "requests": [
                                {
                                    "name": "gpu",
                                    "exactly": {
                                        "deviceClassName": "gpu.flexgpu.dev",
                                        "count": count,
                                    },
                                }
                            ]
                        }
                    }
                },
            }
        )
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": pod},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": NAME},
                    "tolerations": [{**TAINT, "operator": "Equal"}],
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {
                            "name": "main",
                            "image": image,
                            "imagePullPolicy": "Never",
                            "env": [{"name": "REPORT_INTERVAL", "value": "5"}],
                            "resources": {"claims": [{"name": "gpu"}]},
                        }
                    ],
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": pod}],
                },
            }
        )
    return docs


def apply(api: Any, image: str, namespace: str = NAMESPACE) -> None:
    resource: Any = client.ResourceV1Api(api)
    core: Any = client.CoreV1Api(api)
    for doc in manifests(image):
        if doc["kind"] == "Pod":
            core.create_namespaced_pod(namespace, doc)
        else:
            resource.create_namespaced_resource_claim_template(namespace, doc)


def container_seen(pod_logs: Path, pod: str, namespace: str = NAMESPACE) -> Seen:
    """What the container reported from inside, in its latest complete report."""
    found = sorted(
        pod_logs.glob(f"{namespace}_{pod}_*/main/*.log"), key=lambda p: p.stat().st_mtime
    )
    latest = report.latest(found[-1].read_text(errors="replace")) if found else None
    if latest is None:
        return Seen()
    return Seen(
        env=latest.env,
        device_nodes=sorted(latest.devices),
        driver_files=latest.files,
        mounts=latest.mounts,
    )
