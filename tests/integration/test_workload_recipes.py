"""Every recipe of docs/workloads.md does what the page says: each YAML block is applied as
written, a pod uses it on a harness node of eight H100s (GPU 0 shared, GPU 1 dynamic MIG), and
what the container was given is checked against the ``<!-- expect: ... -->`` comment before
the block, which states in data what the prose around it states in words.

Expectation keys: ``devices`` (a count, or ``all``: every device of the class on the node),
``type`` (the devices' ``type`` attribute), ``product`` (prefix of ``productName``),
``profile`` (MIG profile), ``same`` (an attribute all devices share), ``timeSlice``, ``env``
(variables the container gets), ``adminNamespace`` (the namespace carries the admin-access
label, as the page tells).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.conftest import wait_for
from tests.integration.gpu_workloads import DRIVER, REPO, ensure_device_classes, granted, make_pod
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import SimulatedGpuNode

pytestmark = pytest.mark.integration

DOC = REPO / "docs" / "workloads.md"
NODE = "recipes"
_RECIPE = re.compile(r"<!-- expect: (.*?) -->\n```yaml\n(.*?)```", re.DOTALL)
_KEYS = {"devices", "type", "product", "profile", "same", "timeSlice", "env", "adminNamespace"}
ADMIN_LABEL = "resource.kubernetes.io/admin-access"


def recipes() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    found = [
        (yaml.safe_load(e), yaml.safe_load(body)) for e, body in _RECIPE.findall(DOC.read_text())
    ]
    return found


def test_every_yaml_block_of_the_page_is_a_checked_recipe() -> None:
    """No recipe escapes the check: every YAML block has its expectation, and every
    expectation uses known keys."""
    text = DOC.read_text()
    # Gang recipes (a PodGroup and its pods) need the workload gates: test_podgroup_claims_e2e
    # applies those on a control plane that has them.
    gangs = text.count("<!-- gang: ")
    blocks = text.count("```yaml") - gangs
    found = recipes()
    assert len(found) == blocks >= 10 and gangs >= 2
    for expect, obj in found:
        assert set(expect) <= _KEYS, expect
        assert obj["kind"] in ("ResourceClaimTemplate", "ResourceClaim")


@pytest.fixture(scope="module")
def node(cluster: ControlPlane, api: Any) -> Iterator[SimulatedGpuNode]:
    ensure_device_classes(api)
    sim = SimulatedGpuNode(
        cluster.kubeconfig,
        NODE,
        "hgx-h100-8",
        plugin_args=("--shared-gpus=0", "--dynamic-mig-gpus=1"),
    )
    try:
        sim.start()
        yield sim
    finally:
        sim.cleanup()


@pytest.fixture
def fresh_namespace(api: Any, namespace: str) -> Iterator[str]:
    """The test's namespace; afterwards its pods are gone, so the next recipe finds every
    device free."""
    yield namespace
    core = client.CoreV1Api(api)
    for pod in core.list_namespaced_pod(namespace).items:
        core.delete_namespaced_pod(pod.metadata.name, namespace)
    wait_for(
        lambda: not core.list_namespaced_pod(namespace).items,
        timeout_s=120,
        what=f"pods of {namespace} gone",
    )
    resource = client.ResourceV1Api(api)
    for claim in resource.list_namespaced_resource_claim(namespace).items:
        try:
            resource.delete_namespaced_resource_claim(claim.metadata.name, namespace)
        except client.ApiException as err:
            if err.status != 404:  # a template's claim goes with its pod
                raise


def node_devices(api: Any) -> dict[str, dict[str, Any]]:
    """The node's published devices by name, with plain attribute values."""
    out: dict[str, dict[str, Any]] = {}
    slices = client.ResourceV1Api(api).list_resource_slice(
        field_selector=f"spec.nodeName={NODE},spec.driver={DRIVER}"
    )
    for s in slices.items:
        for d in s.spec.devices or []:
            attrs = {}
            for name, value in (d.attributes or {}).items():
                attrs[name] = next(
                    v for v in (value.string, value.int, value.bool, value.version) if v is not None
                )
            out[d.name] = attrs
    return out


def container_env(node: SimulatedGpuNode, namespace: str, pod: str) -> dict[str, str] | None:
    path = node.root / "kubelet" / "pods" / f"{namespace}_{pod}" / "main.oci.json"
    if not path.exists():
        return None
    return dict(e.split("=", 1) for e in json.loads(path.read_text())["process"]["env"])


@pytest.mark.parametrize(
    ("expect", "obj"),
    [pytest.param(e, o, id=o["metadata"]["name"]) for e, o in recipes()],
)
def test_recipe_does_what_the_page_says(
    api: Any,
    node: SimulatedGpuNode,
    fresh_namespace: str,
    expect: dict[str, Any],
    obj: dict[str, Any],
) -> None:
    ns = fresh_namespace
    core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
    if expect.get("adminNamespace"):
        core.patch_namespace(ns, {"metadata": {"labels": {ADMIN_LABEL: "true"}}})
    name = obj["metadata"]["name"]
    if obj["kind"] == "ResourceClaimTemplate":
        resource.create_namespaced_resource_claim_template(ns, obj)
        ref = {"resourceClaimTemplateName": name}
    else:
        resource.create_namespaced_resource_claim(ns, obj)
        ref = {"resourceClaimName": name}
    core.create_namespaced_pod(ns, make_pod("user", "sleep 600", {"gpu": ref}, NODE))

    env = wait_for(
        lambda: container_env(node, ns, "user"), timeout_s=120, what=f"recipe {name} started"
    )
    got = granted(env)
    published = node_devices(api)
    attrs = [published[d["device"]] for d in got]

    wanted_type = expect.get("type")
    if expect.get("devices") == "all":
        count = sum(1 for a in published.values() if a.get("type") == wanted_type)
        assert len(got) == count >= 2
    else:
        assert len(got) == expect["devices"]
    if wanted_type:
        assert {a["type"] for a in attrs} == {wanted_type}
    if "product" in expect:
        assert all(a["productName"].startswith(expect["product"]) for a in attrs)
    if "profile" in expect:
        assert {a["profile"] for a in attrs} == {expect["profile"]}
    if "same" in expect:
        assert len({a[expect["same"]] for a in attrs}) == 1
    if "timeSlice" in expect:
        assert {d.get("timeSlice") for d in got} == {expect["timeSlice"]}
    for key, value in (expect.get("env") or {}).items():
        assert env.get(key) == str(value), key
