"""Pods written for NVIDIA's device plugin run unchanged on a flexgpu node: a pod whose only
GPU request is ``resources.limits: {nvidia.com/gpu: 1}`` is given a flexgpu GPU through DRA's
extended resources (a DeviceClass with ``extendedResourceName``, as the chart's
``deviceClasses.gpuExtendedResourceName`` makes it), on the kubelet harness. Needs
``DRAExtendedResource``: beta and on from 1.36, GA in 1.37."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.conftest import wait_for
from tests.integration.conftest import running_gpu_node
from tests.integration.gpu_workloads import (
    DRIVER,
    device_uuid,
    env_from_log,
    granted_uuids,
    wait_container_output,
    wait_phase,
)
from tools.cluster import ControlPlane

pytestmark = [
    pytest.mark.integration,
    pytest.mark.requires_k8s("1.36", "extended resources through DRA are beta from 1.36"),
]

NODE = "ext-res"
CLASS = "gpu-extended.flexgpu.dev"
PRINT = "env | grep -E '^FLEXGPU_DEVICE_' | sort; echo DONE; sleep 60"


@contextlib.contextmanager
def extended_class(api: Any) -> Iterator[None]:
    """The whole-GPU class as the chart renders it with gpuExtendedResourceName set."""
    resource = client.ResourceV1Api(api)
    is_gpu = f'device.driver == "{DRIVER}" && device.attributes["{DRIVER}"].type == "gpu"'
    resource.create_device_class(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": CLASS},
            "spec": {
                "selectors": [{"cel": {"expression": is_gpu}}],
                "extendedResourceName": "nvidia.com/gpu",
            },
        }
    )
    try:
        yield
    finally:
        resource.delete_device_class(CLASS)


def _pod(name: str) -> dict[str, Any]:
    # As a device-plugin user writes it: no resourceClaims, only the limit.
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "nodeSelector": {"kubernetes.io/hostname": NODE},
            "containers": [
                {
                    "name": "main",
                    "image": "none",
                    "command": ["/bin/sh", "-c", PRINT],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
        },
    }


def test_a_pod_asking_for_nvidia_gpu_gets_a_flexgpu_gpu(
    cluster: ControlPlane, api: Any, namespace: str
) -> None:
    with extended_class(api), running_gpu_node(cluster, api, NODE, "l4-2-pcie") as node:
        core = client.CoreV1Api(api)
        core.create_namespaced_pod(namespace, _pod("plain"))
        pod = wait_phase(api, namespace, "plain", {"Running"}, timeout_s=90)
        env = env_from_log(wait_container_output(node, namespace, "plain", "DONE"))
        claim_status = pod.status.extended_resource_claim_status
        assert claim_status is not None, "the scheduler made no claim for the extended resource"
        claim = client.ResourceV1Api(api).read_namespaced_resource_claim(
            claim_status.resource_claim_name, namespace
        )
        (result,) = claim.status.allocation.devices.results
        assert (result.driver, result.pool) == (DRIVER, NODE)
        assert granted_uuids(env) == [device_uuid(api, NODE, result.device)]
        core.delete_namespaced_pod("plain", namespace)
        wait_for(
            lambda: not core.list_namespaced_pod(namespace).items, timeout_s=60, what="pod gone"
        )
