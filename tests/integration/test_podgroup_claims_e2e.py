"""Gang scheduling and claims for PodGroups (Kubernetes 1.37, GenericWorkload and
DRAWorkloadResourceClaims on) through the real scheduler, the kubelet harness and the plugin:
the gangs of docs/workloads.md, applied as written, are all Running or all Pending, never
partly; a claim reserved for a PodGroup is prepared once on the node and released when the
last member there leaves; a gang that does not fit binds no pod and holds no device.

The combination matrix runs on the default gates, as a cluster is installed; this module
starts a control plane of its own with the workload gates and crosses the gang with what it
meets here: claim per group or per member x device kind (whole NVLink GPUs, on-demand MIG) x
binding conditions (on, off) x fits or not; and shows why every kubelet needs the gate."""

from __future__ import annotations

import contextlib
import copy
import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.conftest import holds_for, wait_for
from tests.integration.gpu_workloads import (
    DRIVER,
    REPO,
    checkpoint_claims,
    ensure_device_classes,
    env_from_log,
    granted,
    scheduling_report,
    wait_container_output,
)
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import SimulatedGpuNode

pytestmark = [
    pytest.mark.integration,
    pytest.mark.requires_k8s(
        "1.37", why="claims for PodGroups are beta from 1.37 (scheduling.k8s.io/v1beta1)"
    ),
]

NODE = "gang"
GROUP, VERSION = "scheduling.k8s.io", "v1beta1"
PLURALS = {"Workload": "workloads", "PodGroup": "podgroups"}
PRINT = "env | grep -E '^FLEXGPU_' | sort; echo DONE; sleep 300"
# GPUs 0-3 plain (the NVLink claim), 4-7 in DynamicMIG mode (7 x 1g.10gb each).
PLUGIN_ARGS = ("--dynamic-mig-gpus=4,5,6,7",)
_GANG = re.compile(r"<!-- gang: (\w+) -->\n```yaml\n(.*?)```", re.DOTALL)


def recipe(name: str) -> list[dict[str, Any]]:
    """The objects of docs/workloads.md's gang recipe ``name``, in the page's order."""
    blocks = dict(_GANG.findall((REPO / "docs" / "workloads.md").read_text()))
    return [doc for doc in yaml.safe_load_all(blocks[name]) if doc]


@pytest.fixture(scope="module")
def gang_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    plane = ControlPlane(workdir=tmp_path_factory.mktemp("gang-cluster"), workloads=True)
    plane.start()
    yield plane
    plane.stop()


@pytest.fixture(scope="module")
def gang_api(gang_cluster: ControlPlane) -> Any:
    return gang_cluster.api_client()


@pytest.fixture(scope="module")
def node(gang_cluster: ControlPlane, gang_api: Any) -> Iterator[SimulatedGpuNode]:
    ensure_device_classes(gang_api)
    sim = SimulatedGpuNode(
        gang_cluster.kubeconfig,
        NODE,
        "hgx-h100-8",
        plugin_args=(*PLUGIN_ARGS, "--binding-conditions=on"),
        feature_gates=gang_cluster.feature_gates,
    )
    try:
        sim.start()
        yield sim
    finally:
        sim.cleanup()


@pytest.fixture
def ns(gang_api: Any, node: SimulatedGpuNode) -> Iterator[str]:
    """A fresh namespace; afterwards its pods and claims are gone and the node holds no
    record, so the next test finds every GPU free."""
    core = client.CoreV1Api(gang_api)
    name = f"g-{uuid.uuid4().hex[:8]}"
    core.create_namespace({"metadata": {"name": name}})
    wait_for(
        lambda: _exists(lambda: core.read_namespaced_service_account("default", name)),
        what=f"default ServiceAccount in {name}",
    )
    yield name
    for pod in core.list_namespaced_pod(name).items:
        core.delete_namespaced_pod(pod.metadata.name, name, grace_period_seconds=0)
    wait_for(lambda: not core.list_namespaced_pod(name).items, 90, what="pods gone")
    objects = client.CustomObjectsApi(gang_api)
    for plural in PLURALS.values():
        for item in objects.list_namespaced_custom_object(GROUP, VERSION, name, plural)["items"]:
            objects.delete_namespaced_custom_object(
                GROUP, VERSION, name, plural, item["metadata"]["name"]
            )
    client.ResourceV1Api(gang_api).delete_collection_namespaced_resource_claim(name)
    wait_for(lambda: not checkpoint_claims(node), 90, what="no claim record left on the node")
    core.delete_namespace(name)


def _exists(read: Any) -> bool:
    try:
        read()
    except client.ApiException:
        return False
    return True


def apply(api: Any, namespace: str, objects: list[dict[str, Any]], pods: int) -> list[str]:
    """Creates the recipe's objects; its one Pod becomes ``pods`` pods (name suffix -0..),
    running the test's print command. Returns the pod names."""
    names = []
    for obj in objects:
        kind = obj["kind"]
        if kind == "ResourceClaimTemplate":
            client.ResourceV1Api(api).create_namespaced_resource_claim_template(namespace, obj)
        elif kind in PLURALS:
            client.CustomObjectsApi(api).create_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURALS[kind], obj
            )
        elif kind == "Pod":
            base = obj["metadata"]["name"].rsplit("-", 1)[0]
            for i in range(pods):
                pod = copy.deepcopy(obj)
                pod["metadata"]["name"] = f"{base}-{i}"
                container = pod["spec"]["containers"][0]
                container["image"], container["command"] = "none", ["/bin/sh", "-c", PRINT]
                pod["spec"].update(restartPolicy="Never", terminationGracePeriodSeconds=1)
                client.CoreV1Api(api).create_namespaced_pod(namespace, pod)
                names.append(pod["metadata"]["name"])
        else:
            raise AssertionError(f"recipe has an object of kind {kind} this test cannot apply")
    return names


def mig_conditions_published(node: SimulatedGpuNode) -> bool:
    """Whether the node's on-demand MIG devices are published with binding conditions."""
    listed = client.ResourceV1Api(node.api).list_resource_slice(
        field_selector=f"spec.nodeName={NODE},spec.driver={DRIVER}"
    )
    return any(
        bool(device.binding_conditions)
        for item in listed.items
        for device in item.spec.devices or []
        if "-mig-" in device.name
    )


@contextlib.contextmanager
def binding_conditions(node: SimulatedGpuNode, mode: str) -> Iterator[None]:
    """The plugin with binding conditions ``mode`` meanwhile (the fixture's is on). Waits for
    slices that say so: a claim allocated against the last plugin's slices would carry
    conditions that a plugin with them off never decides."""

    def run_with(value: str) -> None:
        if f"--binding-conditions={value}" in node.plugin_args:
            return
        node.stop_plugin()
        node.plugin_args = (*PLUGIN_ARGS, f"--binding-conditions={value}")
        node.start_plugin()
        wait_for(
            lambda: mig_conditions_published(node) == (value == "on"),
            60,
            what=f"slices published with binding conditions {value}",
        )

    run_with(mode)
    try:
        yield
    finally:
        run_with("on")


def pods_by_phase(api: Any, namespace: str) -> dict[str, tuple[str, str]]:
    """Pod name -> (phase, node it is bound to)."""
    return {
        p.metadata.name: (p.status.phase, p.spec.node_name or "")
        for p in client.CoreV1Api(api).list_namespaced_pod(namespace).items
    }


def all_running(api: Any, namespace: str, names: list[str]) -> bool:
    phases = pods_by_phase(api, namespace)
    return all(phases.get(n, ("", ""))[0] == "Running" for n in names)


def podgroup(api: Any, namespace: str, name: str) -> dict[str, Any]:
    obj: dict[str, Any] = client.CustomObjectsApi(api).get_namespaced_custom_object(
        GROUP, VERSION, namespace, "podgroups", name
    )
    return obj


def claims(api: Any, namespace: str) -> list[Any]:
    return list(client.ResourceV1Api(api).list_namespaced_resource_claim(namespace).items)


def prepared_lines(node: SimulatedGpuNode, namespace: str, claim: str) -> int:
    """How often the plugin prepared the claim (its log, every start of it)."""
    logs = sorted((node.root / "logs").glob("plugin-*.log"))
    needle = f"prepared claim {namespace}/{claim}:"
    return sum(path.read_text().count(needle) for path in logs)


def test_gang_shares_one_podgroup_claim_of_four_nvlink_gpus(
    gang_api: Any, node: SimulatedGpuNode, ns: str
) -> None:
    pods = apply(gang_api, ns, recipe("nvlink"), pods=4)
    wait_for(
        lambda: all_running(gang_api, ns, pods),
        120,
        what="the four workers Running",
        explain=lambda: scheduling_report(gang_api, ns),
    )
    # One claim, made from the PodGroup's template, reserved for the PodGroup only.
    (claim,) = claims(gang_api, ns)
    group = podgroup(gang_api, ns, "train-workers")
    assert [s["resourceClaimName"] for s in group["status"]["resourceClaimStatuses"]] == [
        claim.metadata.name
    ]
    assert [(r.api_group, r.resource, r.name) for r in claim.status.reserved_for] == [
        (GROUP, "podgroups", "train-workers")
    ]
    results = claim.status.allocation.devices.results
    assert len(results) == 4 and all(r.device.startswith("gpu-") for r in results)
    # Every worker got the same four GPUs of the one claim.
    seen = set()
    for pod in pods:
        env = env_from_log(wait_container_output(node, ns, pod, "DONE"))
        devices = granted(env)
        assert {d["claimUID"] for d in devices} == {claim.metadata.uid}
        seen.add(tuple(sorted(d["uuid"] for d in devices)))
    assert len(seen) == 1 and len(next(iter(seen))) == 4
    # Prepared once on the node: one record, one prepare, whichever member came first.
    assert list(checkpoint_claims(node)) == [claim.metadata.uid]
    assert prepared_lines(node, ns, claim.metadata.name) == 1

    # Members leave one by one: the claim stays prepared while any is left on the node.
    core = client.CoreV1Api(gang_api)
    for pod in pods[:-1]:
        core.delete_namespaced_pod(pod, ns, grace_period_seconds=0)
    wait_for(lambda: set(pods_by_phase(gang_api, ns)) == {pods[-1]}, 60, what="3 members gone")
    holds_for(
        lambda: claim.metadata.uid in checkpoint_claims(node),
        5,
        "the harness's DRA manager unprepares within a sync (2 s backoff) once no pod uses it",
    )
    core.delete_namespaced_pod(pods[-1], ns, grace_period_seconds=0)
    wait_for(lambda: not checkpoint_claims(node), 60, what="unprepared after the last member")
    assert not list(node.cdi_dir.glob("*.json"))
    # The PodGroup still holds its reservation, so the claim keeps its allocation until the
    # PodGroup goes (the resourceclaim controller's rule); the claim made from the PodGroup's
    # template goes with it.
    holds_for(
        lambda: bool(
            client.ResourceV1Api(gang_api)
            .read_namespaced_resource_claim(claim.metadata.name, ns)
            .status.allocation
        ),
        3,
        "the resourceclaim controller reacts to a pod's deletion within a second here",
    )
    client.CustomObjectsApi(gang_api).delete_namespaced_custom_object(
        GROUP, VERSION, ns, "podgroups", "train-workers"
    )
    wait_for(lambda: not claims(gang_api, ns), 60, what="the PodGroup's claim deleted with it")


@pytest.mark.parametrize("binding", ["on", "off"])
def test_gang_of_eight_mig_partitions_runs_together(
    gang_api: Any, node: SimulatedGpuNode, ns: str, binding: str
) -> None:
    """Eight pods, each with its own 1g.10gb partition made on demand; with binding
    conditions each partition is made before its member is bound."""
    with binding_conditions(node, binding):
        pods = apply(gang_api, ns, recipe("mig"), pods=8)
        wait_for(
            lambda: all_running(gang_api, ns, pods),
            180,
            what="the eight members Running",
            explain=lambda: scheduling_report(gang_api, ns),
        )
        own = claims(gang_api, ns)
        assert len(own) == 8
        uuids = set()
        for claim in own:
            (result,) = claim.status.allocation.devices.results
            assert "-mig-1g10gb-" in result.device
            assert [r.resource for r in claim.status.reserved_for] == ["pods"]
            conditions = result.binding_conditions or []
            assert conditions == ([f"{DRIVER}/PartitionReady"] if binding == "on" else [])
        for pod in pods:
            env = env_from_log(wait_container_output(node, ns, pod, "DONE"))
            (device,) = granted(env)
            assert device["uuid"].startswith("MIG-")
            uuids.add(device["uuid"])
        assert len(uuids) == 8


def test_a_podgroup_claim_of_partitions_waits_for_its_binding_conditions_once(
    gang_api: Any, node: SimulatedGpuNode, ns: str
) -> None:
    """A PodGroup's one claim of two on-demand partitions, binding conditions on: the
    partitions are made once for the group (both devices PartitionReady) and every member
    gets both, from one record."""
    objects = recipe("nvlink")
    template = next(o for o in objects if o["kind"] == "ResourceClaimTemplate")
    is_1g = f'device.attributes["{DRIVER}"].profile == "1g.10gb"'
    template["spec"]["spec"]["devices"] = {
        "requests": [
            {
                "name": "gpus",
                "exactly": {
                    "deviceClassName": "mig.flexgpu.dev",
                    "count": 2,
                    "selectors": [{"cel": {"expression": is_1g}}],
                },
            }
        ]
    }
    for obj in objects:
        for policy in obj["spec"].get("podGroupTemplates") or [obj["spec"]]:
            if "schedulingPolicy" in policy:
                policy["schedulingPolicy"]["gang"]["minCount"] = 3
    pods = apply(gang_api, ns, objects, pods=3)
    wait_for(
        lambda: all_running(gang_api, ns, pods),
        120,
        what="the three members Running",
        explain=lambda: scheduling_report(gang_api, ns),
    )
    (claim,) = claims(gang_api, ns)
    assert [r.resource for r in claim.status.reserved_for] == ["podgroups"]
    results = claim.status.allocation.devices.results
    assert all(r.binding_conditions == [f"{DRIVER}/PartitionReady"] for r in results)
    ready = {
        d.device
        for d in claim.status.devices or []
        for c in d.conditions or []
        if c.type == f"{DRIVER}/PartitionReady" and c.status == "True"
    }
    assert ready == {r.device for r in results} and len(ready) == 2
    assert len(partitions_made(node)) == 2
    given = {
        tuple(
            sorted(
                d["uuid"] for d in granted(env_from_log(wait_container_output(node, ns, p, "DONE")))
            )
        )
        for p in pods
    }
    assert len(given) == 1 and len(next(iter(given))) == 2
    assert list(checkpoint_claims(node)) == [claim.metadata.uid]
    assert prepared_lines(node, ns, claim.metadata.name) == 1


# (kind, binding conditions): members, devices per member, what the node has room for.
TOO_BIG = {
    # Three members of three whole GPUs want nine of the node's eight GPUs; two would fit.
    "whole": (3, {"deviceClassName": "gpu.flexgpu.dev", "count": 3}),
    # Five members of a 7g.80gb partition: the four DynamicMIG GPUs hold four.
    "mig": (
        5,
        {
            "deviceClassName": "mig.flexgpu.dev",
            "selectors": [
                {"cel": {"expression": f'device.attributes["{DRIVER}"].profile == "7g.80gb"'}}
            ],
        },
    ),
}


def gang_objects(name: str, kind: str, min_count: int) -> list[dict[str, Any]]:
    """A template (one claim per member), a PodGroup of ``min_count`` and its member pod."""
    _, exactly = TOO_BIG[kind]
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [{"name": "gpus", "exactly": exactly}]}}},
    }
    group = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PodGroup",
        "metadata": {"name": name},
        "spec": {"schedulingPolicy": {"gang": {"minCount": min_count}}},
    }
    claim = {"name": "gpus", "resourceClaimTemplateName": name}
    container = {"name": "main", "image": "none", "resources": {"claims": [{"name": "gpus"}]}}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{name}-0"},
        "spec": {
            "schedulingGroup": {"podGroupName": name},
            "resourceClaims": [claim],
            "containers": [container],
        },
    }
    return [template, group, pod]


def partitions_made(node: SimulatedGpuNode) -> list[Any]:
    state = json.loads((node.data_dir / "simulated-gpus.json").read_text())
    return [i for g in state["gpus"] for i in g["mig_instances"]]


@pytest.mark.parametrize(("kind", "binding"), [("whole", "on"), ("mig", "on"), ("mig", "off")])
def test_a_gang_that_does_not_fit_binds_no_pod_and_holds_no_device(
    gang_api: Any, node: SimulatedGpuNode, ns: str, kind: str, binding: str
) -> None:
    members, _ = TOO_BIG[kind]
    with binding_conditions(node, binding):
        pods = apply(gang_api, ns, gang_objects("big", kind, members), pods=members)

        def refused() -> bool:
            status = podgroup(gang_api, ns, "big").get("status") or {}
            return any(
                c["type"] == "PodGroupInitiallyScheduled"
                and c["status"] == "False"
                and c.get("reason") == "Unschedulable"
                for c in status.get("conditions") or []
            )

        wait_for(
            refused,
            120,
            what="PodGroup reported Unschedulable",
            explain=lambda: scheduling_report(gang_api, ns),
        )

        def none_bound_nothing_held() -> bool:
            bound = [n for n, (_, where) in pods_by_phase(gang_api, ns).items() if where]
            held = [c.metadata.name for c in claims(gang_api, ns) if c.status.allocation]
            return not (bound or held or checkpoint_claims(node) or partitions_made(node))

        holds_for(
            none_bound_nothing_held,
            15,
            "covers the scheduler's retries of the gang after its first refusal (backoff "
            "from 1 s, doubling) and any partition or prepare a bound member would cause",
        )
        assert set(pods) <= set(pods_by_phase(gang_api, ns))

        # One member fewer fits: the refusal above was the gang's, not the devices'.
        client.CoreV1Api(gang_api).delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        wait_for(lambda: not pods_by_phase(gang_api, ns), 60, what="the big gang gone")
        objects = gang_objects("fits", kind, members - 1)
        fitting = apply(gang_api, ns, objects, pods=members - 1)
        wait_for(
            lambda: all_running(gang_api, ns, fitting),
            180,
            what=f"a gang of {members - 1} Running",
            explain=lambda: scheduling_report(gang_api, ns),
        )


def test_a_kubelet_without_the_gate_refuses_a_podgroup_claim(
    gang_cluster: ControlPlane, gang_api: Any, ns: str
) -> None:
    """Why every kubelet needs DRAWorkloadResourceClaims (admin.md): a node whose kubelet
    runs without it never asks the plugin for a claim reserved for the pod's PodGroup."""
    sim = SimulatedGpuNode(gang_cluster.kubeconfig, "gang-nogate", "hgx-h100-8")
    try:
        sim.start()
        objects = recipe("nvlink")
        pod = next(o for o in objects if o["kind"] == "Pod")
        pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "gang-nogate"}
        # A gang of one: the refusal is per pod, one member shows it.
        for obj in objects:
            policies = obj["spec"].get("podGroupTemplates") or [obj["spec"]]
            for policy in policies if obj["kind"] in PLURALS else ():
                policy["schedulingPolicy"]["gang"]["minCount"] = 1
        (name,) = apply(gang_api, ns, objects, pods=1)

        def refused() -> str:
            events = client.CoreV1Api(gang_api).list_namespaced_event(ns).items
            return next(
                (
                    str(e.message)
                    for e in events
                    if e.involved_object.name == name
                    and e.reason == "FailedPrepareDynamicResources"
                ),
                "",
            )

        message = wait_for(
            refused,
            90,
            what="the kubelet's refusal to prepare",
            explain=lambda: (
                scheduling_report(gang_api, ns)
                + "\n"
                + (sim.harness.log_tail(30) if sim.harness else "")
            ),
        )
        assert "was not created for Pod" in message, message
        assert pods_by_phase(gang_api, ns)[name] == ("Pending", "gang-nogate")
        assert not checkpoint_claims(sim)
    finally:
        client.CoreV1Api(gang_api).delete_collection_namespaced_pod(ns, grace_period_seconds=0)
        wait_for(lambda: not pods_by_phase(gang_api, ns), 60, what="the pod gone")
        sim.cleanup()
