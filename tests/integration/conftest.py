"""Fixtures and helpers shared by the integration tests (the control plane itself is in
tests/conftest.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client

from flexgpu.driver import node_policy
from flexgpu.driver.names import CRD_GROUP
from tests.conftest import wait_for
from tests.integration.gpu_workloads import ensure_device_classes
from tools import gen_crds
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import SimulatedGpuNode

CRD_FILE = gen_crds.CRD_DIR / "flexgpu.dev_gpunodepolicies.yaml"


@contextlib.contextmanager
def running_gpu_node(
    cluster: ControlPlane, api: Any, name: str, topology: str, **options: Any
) -> Iterator[SimulatedGpuNode]:
    """A simulated GPU node with its kubelet plugin running (``options`` as
    ``SimulatedGpuNode`` takes them), the device classes installed; cleaned up on exit."""
    ensure_device_classes(api)
    sim = SimulatedGpuNode(cluster.kubeconfig, name, topology, **options)
    try:
        sim.start()
        yield sim
    finally:
        sim.cleanup()


def _established(api: Any) -> bool:
    crd = client.ApiextensionsV1Api(api).read_custom_resource_definition(node_policy.CRD_NAME)
    conditions = (crd.status.conditions if crd.status else None) or []
    return any(c.type == "Established" and c.status == "True" for c in conditions)


@pytest.fixture(scope="module")
def crd_installed(api: Any) -> Iterator[None]:
    """The GpuNodePolicy CRD as generated, installed (or replaced) and served."""
    manifest = yaml.safe_load(CRD_FILE.read_text(encoding="utf-8"))
    extensions = client.ApiextensionsV1Api(api)
    try:
        extensions.create_custom_resource_definition(manifest)
    except client.ApiException as error:
        if error.status != 409:
            raise
        current = extensions.read_custom_resource_definition(node_policy.CRD_NAME)
        manifest["metadata"]["resourceVersion"] = current.metadata.resource_version
        extensions.replace_custom_resource_definition(node_policy.CRD_NAME, manifest)
    wait_for(lambda: _established(api), what="GpuNodePolicy CRD Established")
    # Established can come a moment before the discovery and storage are ready to serve.
    objects = client.CustomObjectsApi(api)

    def _listable() -> bool:
        try:
            objects.list_cluster_custom_object(CRD_GROUP, node_policy.VERSION, node_policy.PLURAL)
        except client.ApiException:
            return False
        return True

    wait_for(_listable, what="gpunodepolicies served")
    yield
