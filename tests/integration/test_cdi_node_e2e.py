"""End to end over a driver root, as on a GPU node: the plugin runs NVIDIA's generator over a
simulated driver installation (tools/node/driver_root.py), the scheduler allocates, the upstream
kubelet code prepares and the upstream CDI library applies the specs to each container's OCI
spec. A container that names one request of a claim gets that request's GPU only; a container
with two claims gets both claims' GPUs; every container gets the driver's libraries, programs,
hooks and control nodes; a MIG partition comes with its /dev/nvidia-caps nodes."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.conftest import wait_for
from tests.integration.gpu_workloads import (
    DRIVER,
    allocated,
    create_claim,
    device_uuid,
    ensure_device_classes,
    env_from_log,
    gpu_request,
    granted,
    wait_container_output,
    wait_phase,
)
from tests.nvidia_ctk import cdi_hook_names, tools_dir
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import SimulatedGpuNode
from tools.node import driver_root

pytestmark = pytest.mark.integration

NODE = "cdi-h100"
MIG_GPU = 7
CAPS_MAJOR = 511
PRINT = "env | grep -E '^(NVIDIA_VISIBLE_DEVICES|FLEXGPU_DEVICE_)' | sort; echo DONE; sleep 120"


@pytest.fixture(scope="module")
def node(cluster: ControlPlane, api: Any) -> Iterator[SimulatedGpuNode]:
    ensure_device_classes(api)
    root = Path(tempfile.mkdtemp(prefix="fgdr-", dir="/tmp"))
    driver_root.create(root, 8)
    # What the driver lists for MIG capabilities, and the caps major the runtime needs.
    minors = "".join(
        f"gpu{MIG_GPU}/gi{gi}/access {300 + gi}\ngpu{MIG_GPU}/gi{gi}/ci0/access {400 + gi}\n"
        for gi in range(15)
    )
    (root / "proc/driver/nvidia-caps").mkdir(parents=True)
    (root / "proc/driver/nvidia-caps/mig-minors").write_text("config 1\nmonitor 2\n" + minors)
    (root / "proc/devices").write_text(f"Character devices:\n{CAPS_MAJOR} nvidia-caps\n")
    started = SimulatedGpuNode(
        cluster.kubeconfig,
        NODE,
        "hgx-h100-8",
        plugin_args=(f"--driver-root={root}", f"--dynamic-mig-gpus={MIG_GPU}"),
        plugin_env={**os.environ, "PATH": f"{tools_dir()}:{os.environ['PATH']}"},
    )
    started.driver_root = root  # type: ignore[attr-defined]
    try:
        started.start()
        yield started
    finally:
        started.cleanup()


def _oci(node: SimulatedGpuNode, namespace: str, pod: str, container: str) -> dict[str, Any]:
    path = node.root / "kubelet" / "pods" / f"{namespace}_{pod}" / f"{container}.oci.json"
    spec: dict[str, Any] = json.loads(path.read_text())
    return spec


def _gpu_nodes(oci: dict[str, Any]) -> list[str]:
    paths = [d["path"] for d in oci.get("linux", {}).get("devices", [])]
    return sorted(p for p in paths if p.removeprefix("/dev/nvidia").isdigit())


def _container(name: str, claims: list[dict[str, str]]) -> dict[str, Any]:
    return {
        "name": name,
        "image": "none",
        "command": ["/bin/sh", "-c", PRINT],
        "resources": {"claims": claims},
    }


def _output(node: SimulatedGpuNode, namespace: str, pod: str, container: str) -> dict[str, str]:
    wait_for(
        lambda: "DONE" in node.container_log(namespace, pod, container),
        timeout_s=60,
        what=f"{container} printed its env",
    )
    return env_from_log(node.container_log(namespace, pod, container))


def test_containers_get_their_requests_devices_and_the_driver(
    api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    create_claim(api, namespace, "multi", {"requests": [gpu_request("a"), gpu_request("b")]})
    create_claim(api, namespace, "extra", {"requests": [gpu_request()]})
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "split"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "nodeSelector": {"kubernetes.io/hostname": NODE},
            "containers": [
                _container("ca", [{"name": "m", "request": "a"}]),
                _container("cb", [{"name": "m", "request": "b"}]),
                _container("both", [{"name": "m"}, {"name": "x"}]),
            ],
            "resourceClaims": [
                {"name": "m", "resourceClaimName": "multi"},
                {"name": "x", "resourceClaimName": "extra"},
            ],
        },
    }
    client.CoreV1Api(api).create_namespaced_pod(namespace, pod)
    wait_phase(api, namespace, "split", {"Running"}, timeout_s=90)
    by_request = {r.request: r.device for r in allocated(api, namespace, "multi")}
    (extra,) = [r.device for r in allocated(api, namespace, "extra")]
    assert all(r.driver == DRIVER for r in allocated(api, namespace, "multi"))

    def node_of(device: str) -> str:
        return f"/dev/nvidia{device.removeprefix('gpu-')}"

    envs = {c: _output(node, namespace, "split", c) for c in ("ca", "cb", "both")}
    ocis = {c: _oci(node, namespace, "split", c) for c in ("ca", "cb", "both")}
    for container, request in (("ca", "a"), ("cb", "b")):
        assert _gpu_nodes(ocis[container]) == [node_of(by_request[request])]
        (got,) = granted(envs[container])
        assert got["device"] == by_request[request]
        assert got["uuid"] == device_uuid(api, NODE, by_request[request])
    both = sorted([by_request["a"], by_request["b"], extra])
    assert _gpu_nodes(ocis["both"]) == sorted(node_of(d) for d in both)
    assert sorted(g["device"] for g in granted(envs["both"])) == both
    assert {g["claim"] for g in granted(envs["both"])} == {
        f"{namespace}/multi",
        f"{namespace}/extra",
    }
    root = node.driver_root  # type: ignore[attr-defined]
    for container, oci in ocis.items():
        assert envs[container]["NVIDIA_VISIBLE_DEVICES"] == "void"
        mounts = {m["destination"]: m["source"] for m in oci["mounts"]}
        lib = f"/{driver_root.LIB_DIR}/libcuda.so.{driver_root.DRIVER_VERSION}"
        assert mounts[lib] == f"{root}{lib}", container
        assert mounts["/usr/bin/nvidia-smi"] == f"{root}/usr/bin/nvidia-smi"
        devices = {d["path"] for d in oci["linux"]["devices"]}
        assert {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"} <= devices
        # flexgpu-cdi-hooks calls run the toolkit's hooks (driver_edits.combine_hooks): one
        # per claim's spec (a container with two claims gets each spec's common edits).
        hooks = oci["hooks"]["createContainer"]
        assert {os.path.basename(h["path"]) for h in hooks} == {"flexgpu-cdi-hooks"}, container
        assert {"create-symlinks", "update-ldcache"} <= set(cdi_hook_names(hooks)), container


def test_a_mig_partition_comes_with_its_capability_nodes(
    api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    create_claim(
        api,
        namespace,
        "part",
        {
            "requests": [
                {
                    "name": "mig",
                    "exactly": {
                        "deviceClassName": "mig.flexgpu.dev",
                        "selectors": [
                            {
                                "cel": {
                                    "expression": f'device.attributes["{DRIVER}"].profile '
                                    '== "1g.10gb"'
                                }
                            }
                        ],
                    },
                }
            ]
        },
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "mig"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "nodeSelector": {"kubernetes.io/hostname": NODE},
            "containers": [_container("main", [{"name": "p"}])],
            "resourceClaims": [{"name": "p", "resourceClaimName": "part"}],
        },
    }
    client.CoreV1Api(api).create_namespaced_pod(namespace, pod)
    wait_phase(api, namespace, "mig", {"Running"}, timeout_s=90)
    env = env_from_log(wait_container_output(node, namespace, "mig", "DONE"))
    (got,) = granted(env)
    assert got["uuid"].startswith("MIG-")
    oci = _oci(node, namespace, "mig", "main")
    caps = [d for d in oci["linux"]["devices"] if d["path"].startswith("/dev/nvidia-caps/")]
    assert len(caps) == 2 and {d["major"] for d in caps} == {CAPS_MAJOR}
    assert {d["minor"] // 100 for d in caps} == {3, 4}  # its GPU instance and compute instance
    assert _gpu_nodes(oci) == [f"/dev/nvidia{MIG_GPU}"]
