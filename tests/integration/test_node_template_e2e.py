"""A node template is what the plugin publishes: for whole, shared, static MIG and on-demand
MIG GPUs, the kubelet plugin runs on a simulated node of the topology, its ResourceSlices are
read back from the API server, and each is compared field by field with the template
(``driver.template_check``). Only the placeholders may differ, and they must stand for the
node's values consistently: one placeholder for one runtime value, different placeholders for
different values (so an autoscaler's matchAttribute simulation groups devices as the node
does). ``flexgpu node-template --compare-node`` is checked against the same nodes."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from flexgpu.controller import cli
from flexgpu.controller.cli_options import ExitCode
from flexgpu.driver.autoscaler_shapes import cluster_autoscaler_slices
from flexgpu.driver.names import CRD_GROUP
from flexgpu.driver.node_policy import parse_node_policy
from flexgpu.driver.node_template import (
    NodeTemplate,
    TemplatePolicy,
    is_placeholder,
    render_node_template,
)
from flexgpu.driver.template_check import current_pool, template_differences
from flexgpu.driver.topology import load_topology
from tests.conftest import target_minor, wait_for
from tests.integration.conftest import running_gpu_node
from tests.integration.gpu_workloads import DRIVER
from tools.cluster import ControlPlane

pytestmark = pytest.mark.integration

NODE = "e2e-template"
LABEL = "flexgpu.dev/template-test"
# From this release the plugin publishes on-demand partitions with binding conditions.
BINDING_MINOR = 36


def published_specs(api: Any, node: str) -> list[dict[str, Any]]:
    """The node's current slices as the API server returns them (raw JSON), in plugin order."""
    response: Any = client.ResourceV1Api(api).list_resource_slice(
        field_selector=f"spec.nodeName={node},spec.driver={DRIVER}", _preload_content=False
    )
    return current_pool(json.loads(response.data)["items"])


def assert_template_matches(template: NodeTemplate, specs: list[dict[str, Any]]) -> None:
    found = template_differences(template, specs, NODE)
    assert not found, "\n".join(found[:40])
    # Every placeholder was bound to a value of the node (none left unchecked).
    tokens = {
        v["string"]
        for spec in template.specs
        for d in spec.get("devices") or []
        for v in d["attributes"].values()
        if is_placeholder(v.get("string"))
    }
    assert tokens and tokens <= set(template.placeholders)
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
    # The plugin's default: on-demand partitions carry binding conditions from 1.36.
    policy = dataclasses.replace(policy, binding_conditions=target_minor() >= BINDING_MINOR)
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
        # The command says the same of the node, and tells a template of another policy apart.
        command = ["node-template", "--topology", topology, "--kubeconfig", str(cluster.kubeconfig)]
        assert cli.main([*command, *plugin_args, "--compare-node", NODE]) == ExitCode.OK
        other = [*command, "--dynamic-mig-gpus=1", "--compare-node", NODE]
        assert cli.main(other) == ExitCode.CHECK_FAILED


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
        load_topology("hgx-h100-8"),
        TemplatePolicy(
            policy=parse_node_policy(static_mig_policy),
            binding_conditions=target_minor() >= BINDING_MINOR,
        ),
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
