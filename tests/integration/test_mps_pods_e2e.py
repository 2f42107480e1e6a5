"""MPS control daemons as pods of their own, on the harness (which runs pods as local
processes, so a daemon pod outlives the plugin process as it does on a node): an MPS claim
starts its GPU's daemon pod, owned by the Node; a plugin restart leaves clients their daemon;
a daemon that crashed is started again and a Node Event says so; the last share's unprepare
deletes the pod. A claim's on-demand MIG partition shared with MPS gets a daemon pod of its
own that sees only the partition and is told the claim's limits on its control pipe; the
parent GPU stays in its compute mode, and the claim's end removes the pod, then the
partition."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.conftest import wait_for
from tests.integration.gpu_workloads import (
    create_claim,
    ensure_device_classes,
    env_from_log,
    granted,
    make_pod,
    wait_container_output,
    wait_gone,
)
from tests.nvidia_ctk import tools_dir
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import SimulatedGpuNode
from tools.node import driver_root

pytestmark = pytest.mark.integration

NODE = "mps-h100"
DYNAMIC_GPU = 7
MPS_NAMESPACE = "flexgpu-mps-e2e"
PRINT = "env | grep -E '^(FLEXGPU_DEVICE_|CUDA_MPS)' | sort; echo DONE; sleep 300"
API = "gpu.flexgpu.dev/v1alpha1"


@pytest.fixture(scope="module")
def node(cluster: ControlPlane, api: Any) -> Iterator[SimulatedGpuNode]:
    ensure_device_classes(api)
    core = client.CoreV1Api(api)
    try:
        core.create_namespace({"metadata": {"name": MPS_NAMESPACE}})
    except client.ApiException as err:
        if err.status != 409:
            raise
    root = Path(tempfile.mkdtemp(prefix="fgmps-", dir="/tmp"))
    driver_root.create(root / "driver", 8)
    control = root / "driver" / driver_root.BIN_DIR / "nvidia-cuda-mps-control"
    # In a pod the daemon stays in the foreground (-f), as nvidia-cuda-mps-control does.
    control.write_text(
        control.read_text().replace(
            'if [ "$1" = "serve" ]; then', 'if [ "$1" = "serve" ] || [ "$1" = "-f" ]; then'
        )
    )
    started = SimulatedGpuNode(
        cluster.kubeconfig,
        NODE,
        "hgx-h100-8",
        plugin_args=(
            f"--driver-root={root / 'driver'}",
            f"--mps-namespace={MPS_NAMESPACE}",
            "--mps-image=flexgpu:test",
            f"--mps-root={root / 'mps'}",
            f"--dynamic-mig-gpus={DYNAMIC_GPU}",
        ),
        plugin_env={**os.environ, "PATH": f"{tools_dir()}:{os.environ['PATH']}"},
    )
    try:
        started.start()
        yield started
    finally:
        started.cleanup()
        shutil.rmtree(root, ignore_errors=True)  # the fake driver root and the daemons' folders


def _daemon_pods(api: Any) -> list[Any]:
    pods = client.CoreV1Api(api).list_namespaced_pod(
        MPS_NAMESPACE, label_selector="app.kubernetes.io/component=mps-control-daemon"
    )
    return [p for p in pods.items if p.spec.node_name == NODE]


def _running_daemon(api: Any) -> Any:
    def running() -> Any:
        pods = [p for p in _daemon_pods(api) if p.status.phase == "Running"]
        return pods[0] if len(pods) == 1 else None

    return wait_for(running, timeout_s=60, what="one running MPS daemon pod")


def _node_events(api: Any, reason: str) -> list[str]:
    events = client.CoreV1Api(api).list_namespaced_event("default").items
    return [e.message for e in events if e.reason == reason and e.involved_object.name == NODE]


def test_mps_daemon_pod_outlives_the_plugin_restarts_after_a_crash_and_goes_with_the_last_share(
    api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    mps = {
        "opaque": {
            "driver": "gpu.flexgpu.dev",
            "parameters": {
                "apiVersion": API,
                "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 30}},
            },
        }
    }
    create_claim(
        api,
        namespace,
        "mps",
        {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.flexgpu.dev"}}],
            "config": [mps],
        },
    )
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(
        namespace, make_pod("client", PRINT, {"g": {"resourceClaimName": "mps"}}, NODE)
    )
    env = env_from_log(wait_container_output(node, namespace, "client", "DONE", timeout_s=90))
    (got,) = granted(env)
    daemon = _running_daemon(api)
    assert daemon.metadata.annotations["gpu.flexgpu.dev/gpu-uuid"] == got["uuid"]
    (owner,) = daemon.metadata.owner_references
    assert (owner.kind, owner.name) == ("Node", NODE)
    assert daemon.spec.containers[0].resources.limits["memory"] == "256Mi"
    pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"])
    assert (pipe / "control").exists() and env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    first_pid = int((pipe / "nvidia-cuda-mps-control.pid").read_text())

    # A plugin restart (or upgrade) leaves the client its daemon: same pod, same process.
    node.stop_plugin()
    node.start_plugin()
    plugin = node.plugin
    assert plugin is not None
    wait_for(lambda: "stopped 0 MPS daemon(s)" in plugin.log_tail(80), what="reconcile summary")
    assert _running_daemon(api).metadata.uid == daemon.metadata.uid
    os.kill(first_pid, 0)  # still alive

    # The daemon crashes: the plugin starts it again and says so on the Node.
    os.kill(first_pid, signal.SIGKILL)
    replaced = wait_for(
        lambda: [
            p
            for p in _daemon_pods(api)
            if p.metadata.uid != daemon.metadata.uid and p.status.phase == "Running"
        ],
        timeout_s=90,
        what="a new MPS daemon pod",
    )
    assert len(replaced) == 1
    (message,) = wait_for(lambda: _node_events(api, "MpsDaemonRestarted"), what="an Event")
    assert f"({got['uuid']}) ended (exit code 137" in message
    wait_for((pipe / "control").exists, what="the new daemon's control pipe")
    assert int((pipe / "nvidia-cuda-mps-control.pid").read_text()) != first_pid

    # The last share goes: so does the daemon pod.
    core.delete_namespaced_pod("client", namespace)
    wait_gone(api, namespace, "client")
    wait_for(lambda: _daemon_pods(api) == [], timeout_s=60, what="the daemon pod deleted")


def _simulated_gpu(node: SimulatedGpuNode, index: int) -> dict[str, Any]:
    gpus: list[dict[str, Any]] = json.loads((node.data_dir / "simulated-gpus.json").read_text())[
        "gpus"
    ]
    return gpus[index]


def test_a_mig_partition_shared_with_mps_gets_a_daemon_pod_of_its_own(
    api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    mps = {
        "opaque": {
            "driver": "gpu.flexgpu.dev",
            "parameters": {
                "apiVersion": API,
                "kind": "MigDeviceConfig",
                "sharing": {
                    "strategy": "MPS",
                    "mpsConfig": {
                        "defaultActiveThreadPercentage": 30,
                        "defaultPinnedDeviceMemoryLimit": "2Gi",
                    },
                },
            },
        }
    }
    profile = 'device.attributes["gpu.flexgpu.dev"].profile == "1g.10gb"'
    request = {
        "deviceClassName": "mig.flexgpu.dev",
        "selectors": [{"cel": {"expression": profile}}],
    }
    create_claim(
        api,
        namespace,
        "mig-mps",
        {"requests": [{"name": "mig", "exactly": request}], "config": [mps]},
    )
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(
        namespace, make_pod("mig-client", PRINT, {"g": {"resourceClaimName": "mig-mps"}}, NODE)
    )
    env = env_from_log(wait_container_output(node, namespace, "mig-client", "DONE", timeout_s=90))
    (got,) = granted(env)
    uuid = got["uuid"]
    assert uuid.startswith("MIG-")
    daemon = _running_daemon(api)
    assert daemon.metadata.name == f"flexgpu-mps-{uuid.lower()}"[:63].rstrip("-")
    assert daemon.metadata.annotations["gpu.flexgpu.dev/gpu-uuid"] == uuid
    assert daemon.metadata.labels["gpu.flexgpu.dev/gpu-index"] == str(DYNAMIC_GPU)
    pod_env = {e.name: e.value for e in daemon.spec.containers[0].env}
    assert pod_env["CUDA_VISIBLE_DEVICES"] == uuid
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == pod_env["CUDA_MPS_PIPE_DIRECTORY"]
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"
    # The daemon heard the claim's limits on its control pipe (the driver root's daemon logs
    # every command it serves).
    assert "CUDA_MPS_LOG_DIRECTORY" not in env  # the daemon's log stays the daemon's
    log = Path(pod_env["CUDA_MPS_LOG_DIRECTORY"]) / "control.log"
    wait_for(
        lambda: (
            "command set_default_active_thread_percentage 30" in log.read_text()
            and f"command set_default_device_pinned_mem_limit {uuid} 2048M" in log.read_text()
        ),
        what="the claim's limits sent to the daemon",
    )
    assert f"started for {uuid}" in log.read_text()
    gpu = _simulated_gpu(node, DYNAMIC_GPU)
    assert gpu["compute_mode"] == "Default" and [i["uuid"] for i in gpu["mig_instances"]] == [uuid]

    core.delete_namespaced_pod("mig-client", namespace)
    wait_gone(api, namespace, "mig-client")
    wait_for(lambda: _daemon_pods(api) == [], timeout_s=60, what="the daemon pod deleted")
    wait_for(
        lambda: _simulated_gpu(node, DYNAMIC_GPU)["mig_instances"] == [],
        timeout_s=60,
        what="the partition destroyed",
    )
