"""Manifests written for NVIDIA's DRA driver run on flexgpu with only the driver, apiVersion and
class names changed: the quickstart's gpu-test1..6 and its MPS example, applied with kubectl to
a harness node of eight A100 40GB GPUs (odd ones in dynamic MIG mode), each checked for what
its quickstart says it does, from what every container was given (its OCI spec after CDI).

Not run: NVIDIA's MIG + MPS example, which shares MIG devices with MPS (refused by flexgpu for
now: MIG devices are Exclusive only), and the VFIO and IMEX examples (features flexgpu does not
have).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.conftest import wait_for
from tests.integration.conftest import running_gpu_node
from tests.integration.gpu_workloads import granted
from tools.cluster import ControlPlane
from tools.cluster.binaries import helm_tools_dir
from tools.cluster.gpu_node import SimulatedGpuNode

pytestmark = pytest.mark.integration

HERE = Path(__file__).parent / "nvidia_quickstart"
NODE = "quickstart"
# 10Gi in MiB, as the MPS client limit is written.
TEN_GI = "0=10240M"


@pytest.fixture(scope="module")
def node(cluster: ControlPlane, api: Any) -> Iterator[SimulatedGpuNode]:
    with running_gpu_node(
        cluster,
        api,
        NODE,
        str(HERE / "a100-40gb-8.yaml"),
        plugin_args=("--dynamic-mig-gpus=1,3,5,7",),
    ) as sim:
        yield sim


def kubectl(cluster: ControlPlane, *args: str) -> None:
    subprocess.run(
        [str(helm_tools_dir() / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )


@pytest.fixture
def manifest(
    request: pytest.FixtureRequest, cluster: ControlPlane, api: Any, node: SimulatedGpuNode
) -> Iterator[str]:
    """Applies the manifest; afterwards deletes its namespace and waits until it is gone, so
    the next manifest finds every GPU free."""
    name: str = request.param
    path = HERE / f"{name}.yaml"
    namespace = next(
        d["metadata"]["name"]
        for d in yaml.safe_load_all(path.read_text())
        if d["kind"] == "Namespace"
    )
    kubectl(cluster, "apply", "-f", str(path))
    try:
        yield namespace
    finally:
        kubectl(cluster, "delete", "namespace", namespace, "--wait=false")

        def gone() -> bool:
            try:
                client.CoreV1Api(api).read_namespace(namespace)
            except client.ApiException as err:
                return err.status == 404
            return False

        wait_for(gone, timeout_s=180, what=f"namespace {namespace} deleted")


def given(
    api: Any, node: SimulatedGpuNode, namespace: str, pods: int
) -> dict[str, dict[str, dict[str, str]]]:
    """Per pod and container, the environment it was started with, once ``pods`` pods have
    every container created."""
    core = client.CoreV1Api(api)

    def read() -> dict[str, dict[str, dict[str, str]]] | None:
        found: dict[str, dict[str, dict[str, str]]] = {}
        for pod in core.list_namespaced_pod(namespace).items:
            folder = node.root / "kubelet" / "pods" / f"{namespace}_{pod.metadata.name}"
            envs = {}
            for container in pod.spec.containers:
                path = folder / f"{container.name}.oci.json"
                if not path.exists():
                    return None
                env = json.loads(path.read_text())["process"]["env"]
                envs[container.name] = dict(e.split("=", 1) for e in env)
            found[pod.metadata.name] = envs
        return found if len(found) == pods else None

    result: dict[str, dict[str, dict[str, str]]] = wait_for(
        read, timeout_s=180, what=f"{pods} pods of {namespace} with every container created"
    )
    return result


def devices(env: dict[str, str]) -> list[dict[str, str]]:
    return granted(env)


def only(env: dict[str, str]) -> dict[str, str]:
    (device,) = devices(env)
    return device


@pytest.mark.parametrize("manifest", ["gpu-test1"], indirect=True)
def test_gpu_test1_two_pods_get_a_gpu_each(api: Any, node: SimulatedGpuNode, manifest: str) -> None:
    pods = given(api, node, manifest, 2)
    uuids = {only(pods[p]["ctr"])["uuid"] for p in ("pod1", "pod2")}
    assert len(uuids) == 2 and all(u.startswith("GPU-") for u in uuids)


@pytest.mark.parametrize("manifest", ["gpu-test2"], indirect=True)
def test_gpu_test2_two_containers_share_one_gpu(
    api: Any, node: SimulatedGpuNode, manifest: str
) -> None:
    (containers,) = given(api, node, manifest, 1).values()
    assert only(containers["ctr0"])["uuid"] == only(containers["ctr1"])["uuid"]


@pytest.mark.parametrize("manifest", ["gpu-test3"], indirect=True)
def test_gpu_test3_two_pods_share_one_claims_gpu(
    api: Any, node: SimulatedGpuNode, manifest: str
) -> None:
    pods = given(api, node, manifest, 2)
    first, second = (only(pods[p]["ctr"]) for p in ("pod1", "pod2"))
    assert first["uuid"] == second["uuid"] and first["claim"] == second["claim"]


@pytest.mark.parametrize("manifest", ["gpu-test4"], indirect=True)
def test_gpu_test4_replicas_get_four_mig_devices_of_one_gpu(
    api: Any, node: SimulatedGpuNode, manifest: str
) -> None:
    pods = given(api, node, manifest, 4)
    parents = set()
    for containers in pods.values():
        names = {c: only(env)["device"] for c, env in containers.items()}
        profiles = {c: name.split("-mig-")[1].rsplit("-", 1)[0] for c, name in names.items()}
        assert profiles == {"ctr0": "1g5gb", "ctr1": "1g5gb", "ctr2": "2g10gb", "ctr3": "3g20gb"}
        (parent,) = {name.split("-mig-")[0] for name in names.values()}
        assert len(set(names.values())) == 4 and all(
            only(env)["uuid"].startswith("MIG-") for env in containers.values()
        )
        parents.add(parent)
    assert parents == {"gpu-1", "gpu-3", "gpu-5", "gpu-7"}  # the GPUs in MIG mode


@pytest.mark.parametrize("manifest", ["gpu-test5"], indirect=True)
def test_gpu_test5_one_gpu_time_sliced_and_one_through_mps(
    api: Any, node: SimulatedGpuNode, manifest: str
) -> None:
    (containers,) = given(api, node, manifest, 1).values()
    ts = [only(containers[c]) for c in ("ts-ctr0", "ts-ctr1")]
    mps = [only(containers[c]) for c in ("mps-ctr0", "mps-ctr1")]
    assert ts[0]["uuid"] == ts[1]["uuid"] and mps[0]["uuid"] == mps[1]["uuid"]
    assert ts[0]["uuid"] != mps[0]["uuid"]
    assert {d.get("timeSlice") for d in ts} == {"Long"}
    for name in ("mps-ctr0", "mps-ctr1"):
        env = containers[name]
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == TEN_GI
    assert "CUDA_MPS_PIPE_DIRECTORY" not in containers["ts-ctr0"]


@pytest.mark.parametrize("manifest", ["gpu-test6"], indirect=True)
def test_gpu_test6_replicas_get_the_even_a100s_time_sliced(
    api: Any, node: SimulatedGpuNode, manifest: str
) -> None:
    pods = given(api, node, manifest, 4)
    got = [only(containers["ctr"]) for containers in pods.values()]
    assert sorted(d["device"] for d in got) == ["gpu-0", "gpu-2", "gpu-4", "gpu-6"]
    assert {d.get("timeSlice") for d in got} == {"Long"}


@pytest.mark.parametrize("manifest", ["gpu-test-mps"], indirect=True)
def test_gpu_test_mps_two_containers_share_a_gpu_through_mps(
    api: Any, node: SimulatedGpuNode, manifest: str
) -> None:
    (containers,) = given(api, node, manifest, 1).values()
    first, second = containers["mps-ctr0"], containers["mps-ctr1"]
    assert only(first)["uuid"] == only(second)["uuid"]
    for env in (first, second):
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == TEN_GI
    assert first["CUDA_MPS_PIPE_DIRECTORY"] == second["CUDA_MPS_PIPE_DIRECTORY"]
