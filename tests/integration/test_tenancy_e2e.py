"""Shared GPUs never mix tenants, end to end: 20 fractional claims of 4 namespaces, created at
once with their pods on a node with 2 shared GPUs, allocated by the real scheduler and
prepared through the upstream kubelet code (which calls prepare concurrently). Whatever the
scheduler allocates, no MPS daemon (pipe folder) and no GPU ever serves two namespaces: the
containers that run share a daemon only with their own namespace, the node's claim records of
each GPU belong to one namespace, and every pod that would have mixed is held back with the
plugin's reason in its Event until the namespace holding the GPU is gone."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.conftest import wait_for
from tests.integration.conftest import running_gpu_node
from tests.integration.gpu_workloads import (
    checkpoint_claims,
    create_claim,
    env_from_log,
    make_pod,
)
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import SimulatedGpuNode

pytestmark = pytest.mark.integration

NODE = "e2e-tenants"
PRINT = "env | grep -E '^CUDA_MPS' | sort; echo DONE; sleep 300"
TENANTS = 4
CLAIMS_PER_TENANT = 5
REFUSED = "serves one namespace at a time"


@pytest.fixture(scope="module")
def node(cluster: ControlPlane, api: Any) -> Iterator[SimulatedGpuNode]:
    with running_gpu_node(
        cluster, api, NODE, "hgx-h100-8", plugin_args=("--shared-gpus=0,1",)
    ) as sim:
        yield sim


@pytest.fixture
def tenants(api: Any) -> Iterator[list[str]]:
    core = client.CoreV1Api(api)
    names = [f"tenant-{uuid.uuid4().hex[:6]}-{i}" for i in range(TENANTS)]
    for name in names:
        core.create_namespace({"metadata": {"name": name}})
    yield names
    for name in names:
        core.delete_namespace(name)


def _share() -> dict[str, Any]:
    exactly = {
        "deviceClassName": "shared-gpu.flexgpu.dev",
        "capacity": {"requests": {"memory": "4Gi"}},
    }
    return {"requests": [{"name": "gpu", "exactly": exactly}]}


def _refusal(api: Any, namespace: str, pod: str) -> str:
    for event in client.CoreV1Api(api).list_namespaced_event(namespace).items:
        if event.involved_object.name == pod and event.reason == "FailedPrepareDynamicResources":
            return str(event.message)
    return ""


@pytest.mark.requires_k8s(
    "1.35", why="1.34's alpha consumable-capacity allocator packs fractions unreliably"
)
def test_fractions_of_four_namespaces_created_at_once_never_share_a_daemon(
    api: Any, tenants: list[str], node: SimulatedGpuNode
) -> None:
    core = client.CoreV1Api(api)
    pods = [(ns, f"share-{i}") for ns in tenants for i in range(CLAIMS_PER_TENANT)]
    for ns, name in pods:
        create_claim(api, ns, name, _share())
    for ns, name in pods:
        core.create_namespaced_pod(
            ns, make_pod(name, PRINT, {"g": {"resourceClaimName": name}}, NODE)
        )

    def settled() -> dict[tuple[str, str], str] | None:
        """Each pod's outcome once every pod ran or was refused: its pipe folder, or ''."""
        outcome = {}
        for ns, name in pods:
            log = node.container_log(ns, name, "main")
            if "DONE" in log:
                outcome[(ns, name)] = env_from_log(log)["CUDA_MPS_PIPE_DIRECTORY"]
            elif REFUSED in _refusal(api, ns, name):
                outcome[(ns, name)] = ""
            else:
                return None
        return outcome

    outcome = wait_for(settled, timeout_s=180, what="every pod running or refused")
    by_pipe: dict[str, set[str]] = {}
    for (ns, _), pipe in outcome.items():
        if pipe:
            by_pipe.setdefault(pipe, set()).add(ns)
    assert by_pipe, "no pod ran"
    assert all(len(namespaces) == 1 for namespaces in by_pipe.values()), by_pipe
    # The node's records agree: each shared GPU's prepared claims are of one namespace.
    by_gpu: dict[str, set[str]] = {}
    for record in checkpoint_claims(node).values():
        if record["namespace"] not in tenants:
            continue
        for device in record["devices"]:
            by_gpu.setdefault(device["device_name"], set()).add(record["namespace"])
    assert by_gpu and all(len(namespaces) == 1 for namespaces in by_gpu.values()), by_gpu
    # A refused pod's namespace is not the one its GPU serves (it was refused for a mix).
    refused = [key for key, pipe in outcome.items() if not pipe]
    served = set().union(*by_pipe.values())
    for ns, name in refused:
        message = _refusal(api, ns, name)
        holder = message.split(" is shared by claim ", 1)[1].split("/", 1)[0]
        assert holder in served and holder != ns, message
    # Two shared GPUs serve at most two namespaces; the rest were refused, none mixed in.
    assert 1 <= len(served) <= 2 and len(refused) >= (TENANTS - 2) * CLAIMS_PER_TENANT

    # Once the served namespaces' pods are gone, their GPUs serve a waiting namespace: the
    # kubelet's next prepare of a refused pod goes through, on a daemon of its own.
    for ns, name in outcome:
        if ns in served:
            core.delete_namespaced_pod(name, ns, grace_period_seconds=0)

    def next_tenant_runs() -> str:
        for ns, name in refused:
            log = node.container_log(ns, name, "main")
            if "DONE" in log:
                return ns
        return ""

    follower = wait_for(next_tenant_runs, timeout_s=180, what="a waiting namespace's pod running")
    assert follower not in served
