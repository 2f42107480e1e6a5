"""A node template is what the plugin publishes: for whole, shared, static MIG and on-demand
MIG GPUs, the kubelet plugin runs on a simulated node of the topology, its ResourceSlices are
read back from the API server, and each is compared field by field with the template. Only the
placeholders may differ, and they must stand for the node's values consistently: one
placeholder for one runtime value, different placeholders for different values (so an
autoscaler's matchAttribute simulation groups devices as the node does)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from flexgpu.driver.autoscaler_shapes import cluster_autoscaler_slices
from flexgpu.driver.names import CRD_GROUP
from flexgpu.driver.node_policy import parse_node_policy
from flexgpu.driver.node_template import (
    NODE_NAME_PLACEHOLDER,
    NodeTemplate,
    TemplatePolicy,
    is_placeholder,
    render_node_template,
)
from flexgpu.driver.topology import load_topology
from tests.conftest import wait_for
from tests.integration.conftest import running_gpu_node
from tests.integration.gpu_workloads import DRIVER
from tools.cluster import ControlPlane

pytestmark = pytest.mark.integration

NODE = "e2e-template"
LABEL = "flexgpu.dev/template-test"


def published_specs(api: Any, node: str) -> list[dict[str, Any]]:
    """The node's slices as the API server returns them (raw JSON), in the plugin's order."""
    response: Any = client.ResourceV1Api(api).list_resource_slice(
        field_selector=f"spec.nodeName={node},spec.driver={DRIVER}", _preload_content=False
    )
    items = json.loads(response.data)["items"]
    # Slice names end in their position: <node>-gpu.flexgpu.dev-<i>.
    items.sort(key=lambda item: int(item["metadata"]["name"].rsplit("-", 1)[1]))
    return [item["spec"] for item in items]


class Placeholders:
    """Placeholder <-> runtime value, both ways one-to-one."""

    def __init__(self, node: str) -> None:
        self.value: dict[str, Any] = {NODE_NAME_PLACEHOLDER: node}
        self.token: dict[Any, str] = {node: NODE_NAME_PLACEHOLDER}

    def bind(self, placeholder: str, real: Any, path: str) -> list[str]:
        known = self.value.setdefault(placeholder, real)
        if known != real:
            return [f"{path}: {placeholder} stands for {known!r} elsewhere, here for {real!r}"]
        other = self.token.setdefault(real, placeholder)
        if other != placeholder:
            return [f"{path}: {real!r} is {other} elsewhere, here {placeholder}"]
        return []


def differences(template: Any, real: Any, path: str, placeholders: Placeholders) -> list[str]:
    if is_placeholder(template):
        return placeholders.bind(template, real, path)
    if isinstance(template, dict) and isinstance(real, dict):
        found = [f"{path}.{k}: only in the template" for k in template.keys() - real.keys()]
        found += [f"{path}.{k}: only on the node" for k in real.keys() - template.keys()]
        for key in template.keys() & real.keys():
            found += differences(template[key], real[key], f"{path}.{key}", placeholders)
        return found
    if isinstance(template, list) and isinstance(real, list):
        if len(template) != len(real):
            return [f"{path}: {len(template)} entries in the template, {len(real)} on the node"]
        found = []
        for i, (t, r) in enumerate(zip(template, real, strict=True)):
            name = t.get("name", i) if isinstance(t, dict) else i
            found += differences(t, r, f"{path}[{name}]", placeholders)
        return found
    return [] if template == real else [f"{path}: template {template!r}, node {real!r}"]


def assert_template_matches(template: NodeTemplate, specs: list[dict[str, Any]]) -> None:
    assert len(template.specs) == len(specs), (len(template.specs), len(specs))
    placeholders = Placeholders(NODE)
    found: list[str] = []
    for i, (mine, published) in enumerate(zip(template.specs, specs, strict=True)):
        # The generation counts the node's own republishes: runtime-only, a template says 1.
        pool = {**published["pool"], "generation": mine["pool"]["generation"]}
        found += differences(mine, {**published, "pool": pool}, f"slice[{i}]", placeholders)
    assert not found, "\n".join(found[:40])
    # The cluster-autoscaler shape carries the same specs.
    shaped = cluster_autoscaler_slices(template)["items"]
    assert [item["spec"] for item in shaped] == template.specs


def device_names(specs: list[dict[str, Any]]) -> list[str]:
    return [d["name"] for spec in specs for d in spec.get("devices") or []]


@pytest.mark.parametrize(
    ("topology", "plugin_args", "policy"),
    [
        pytest.param("hgx-h100-8", (), TemplatePolicy(), id="whole"),
        pytest.param(
            "l4-2-pcie",
            ("--shared-gpus=all",),
            TemplatePolicy(shared=frozenset({0, 1})),
            id="shared",
        ),
        pytest.param(
            "hgx-h100-8",
            ("--shared-gpus=0", "--dynamic-mig-gpus=6,7"),
            TemplatePolicy(shared=frozenset({0}), dynamic_mig=frozenset({6, 7})),
            id="on-demand-mig",
        ),
    ],
)
def test_template_is_what_the_plugin_publishes(
    cluster: ControlPlane,
    api: Any,
    topology: str,
    plugin_args: tuple[str, ...],
    policy: TemplatePolicy,
) -> None:
    template = render_node_template(load_topology(topology), policy)
    with running_gpu_node(cluster, api, NODE, topology, plugin_args=plugin_args):
        specs = wait_for(
            lambda: (
                (s := published_specs(api, NODE))
                and len(s) == s[0]["pool"]["resourceSliceCount"]
                and s
            ),
            what="the node's complete pool",
        )
        assert_template_matches(template, specs)


STATIC_MIG_POLICY: dict[str, Any] = {
    "apiVersion": "flexgpu.dev/v1alpha1",
    "kind": "GpuNodePolicy",
    "metadata": {"name": "template-static-mig"},
    "spec": {
        "nodeSelector": {"matchLabels": {LABEL: "static-mig"}},
        "gpus": [
            {"selector": {"indices": [1]}, "mode": "MIG", "migLayout": {"3g.40gb": 2}},
            {
                "selector": {"indices": [2, 3]},
                "mode": "MIG",
                "migLayout": {"2g.20gb": 1, "1g.10gb": 4},
            },
            {"selector": {"indices": [4]}, "mode": "Shared"},
            {"selector": {"indices": [5]}, "mode": "DynamicMIG"},
        ],
    },
}


@pytest.fixture
def static_mig_policy(api: Any, crd_installed: None) -> Iterator[dict[str, Any]]:
    custom = client.CustomObjectsApi(api)
    custom.create_cluster_custom_object(CRD_GROUP, "v1alpha1", "gpunodepolicies", STATIC_MIG_POLICY)
    try:
        yield STATIC_MIG_POLICY
    finally:
        custom.delete_cluster_custom_object(
            CRD_GROUP, "v1alpha1", "gpunodepolicies", STATIC_MIG_POLICY["metadata"]["name"]
        )


def test_static_mig_policy_template_is_what_the_plugin_publishes(
    cluster: ControlPlane, api: Any, static_mig_policy: dict[str, Any]
) -> None:
    """The same GpuNodePolicy object drives the template and the node's policy agent."""
    template = render_node_template(
        load_topology("hgx-h100-8"), TemplatePolicy(policy=parse_node_policy(static_mig_policy))
    )
    wanted = device_names(template.specs)
    assert "gpu-1-mig-3g40gb-0" in wanted and "gpu-1" not in wanted
    with running_gpu_node(cluster, api, NODE, "hgx-h100-8"):
        client.CoreV1Api(api).patch_node(NODE, {"metadata": {"labels": {LABEL: "static-mig"}}})
        specs = wait_for(
            lambda: (
                (s := published_specs(api, NODE))
                and len(s) == s[0]["pool"]["resourceSliceCount"]
                and device_names(s) == wanted
                # Devices are tainted while a GPU is being changed; the template is the end state.
                and not any("taints" in d for spec in s for d in spec.get("devices") or [])
                and s
            ),
            timeout_s=60,
            what="the policy's layout published",
        )
        assert_template_matches(template, specs)
