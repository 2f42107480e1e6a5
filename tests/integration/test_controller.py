"""The controller process against the real control plane: Events that name why a claim cannot
be allocated (five different reasons), leader election across two processes with a SIGKILL,
and the ``flexgpu explain`` / ``flexgpu capacity`` commands.

Slices are published straight from the simulated backend (no plugin process: nothing has to
run on the nodes), and the real scheduler allocates the claims that take devices first.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from flexgpu.driver import node_policy
from flexgpu.driver.names import CRD_GROUP, DRIVER_NAME
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.topology import load_topology
from flexgpu.kubelet_plugin.api.kube_api import KubeApi
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.devices.slice_publisher import SlicePublisher
from tests.conftest import holds_for, target_minor, wait_for
from tests.integration.gpu_workloads import ensure_device_classes
from tools.cluster import ControlPlane, create_simulated_node

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
REASON = "GpuClaimUnsatisfiable"
RUN_LABEL = "ctl.flexgpu.dev/run"
ZONE_LABEL = "ctl.flexgpu.dev/zone"
TAINT = {"key": "flexgpu.dev/maintenance", "value": "true", "effect": "NoSchedule"}
A = f'device.attributes["{DRIVER_NAME}"]'
CAP = f'device.capacity["{DRIVER_NAME}"]'
# Four H100s linked in two NVLink pairs: two domains of two GPUs.
PAIRS_TOPOLOGY = {
    "name": "h100-pairs",
    "description": "4x H100, NVLink pairs",
    "nvlink": {"fabric": "links", "links": [[0, 1], [2, 3]]},
    "gpus": [{"model": "H100-SXM5-80GB"} for _ in range(4)],
}


@dataclass
class World:
    run: str
    namespace: str
    kube: KubeApi  # what the publishers write with
    nodes: dict[str, str] = field(default_factory=dict)  # role -> node name
    publishers: list[SlicePublisher] = field(default_factory=list)


def _node_devices(topology: Any, node: str, tmp: Path, shared: set[int]) -> NodeDevices:
    backend = SimulatedBackend(topology, node, state_path=tmp / f"{node}.json")
    return NodeDevices(backend, shared=shared)


def _publish(api: Any, world: World, role: str, topology: Any, tmp: Path, **options: Any) -> None:
    node = f"ctl-{world.run}-{role}"
    labels = {RUN_LABEL: world.run, ZONE_LABEL: options.get("zone", "a")}
    create_simulated_node(api, node, labels=labels)
    devices = _node_devices(topology, node, tmp, options.get("shared", set())).slice_devices()
    if options.get("tainted"):
        devices = [{**d, "taints": [TAINT]} for d in devices]
    publisher = SlicePublisher(world.kube, node, resync_interval_s=30)
    publisher.set_devices(devices)
    publisher.reconcile_once()
    world.nodes[role] = node
    world.publishers.append(publisher)


def _claim(api: Any, ns: str, name: str, request: dict[str, Any], **devices: Any) -> None:
    client.ResourceV1Api(api).create_namespaced_resource_claim(
        ns,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}], **devices}},
        },
    )


def _request(cls: str = "gpu.flexgpu.dev", count: int = 1, *cel: str, **extra: Any) -> Any:
    body: dict[str, Any] = {"deviceClassName": cls, "count": count, **extra}
    if cel:
        body["selectors"] = [{"cel": {"expression": e}} for e in cel]
    return body


def _pod(api: Any, ns: str, name: str, claim: str, node_selector: dict[str, str]) -> None:
    client.CoreV1Api(api).create_namespaced_pod(
        ns,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "nodeSelector": node_selector,
                "terminationGracePeriodSeconds": 0,
                "containers": [
                    {"name": "c", "image": "none", "resources": {"claims": [{"name": "g"}]}}
                ],
                "resourceClaims": [{"name": "g", "resourceClaimName": claim}],
            },
        },
    )


def _on(world: World, role: str) -> dict[str, str]:
    return {"kubernetes.io/hostname": world.nodes[role]}


def _scheduled(api: Any, ns: str, pod: str) -> str:
    return str(client.CoreV1Api(api).read_namespaced_pod(pod, ns).spec.node_name or "")


def _events(api: Any, ns: str, kind: str, name: str) -> list[str]:
    events = client.CoreV1Api(api).list_namespaced_event(ns).items
    return [
        e.message
        for e in events
        if e.reason == REASON and e.involved_object.kind == kind and e.involved_object.name == name
    ]


@pytest.fixture(scope="module")
def world(
    api: Any, cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    ensure_device_classes(api)
    _install_policy_crd(api)
    tmp = tmp_path_factory.mktemp("ctl")
    run = uuid.uuid4().hex[:5]
    ns = f"ctl-{run}"
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": ns}})
    wait_for(lambda: _has_default_account(core, ns), what=f"default ServiceAccount in {ns}")
    w = World(run, ns, KubeApi.from_kubeconfig(cluster.kubeconfig))
    pairs = tmp / "pairs.yaml"
    pairs.write_text(yaml.safe_dump(PAIRS_TOPOLOGY))
    _publish(api, w, "l4", load_topology("l4-2-pcie"), tmp)
    _publish(api, w, "h100", load_topology("hgx-h100-8"), tmp, zone="b")
    _publish(api, w, "a100", load_topology("dgx-a100-8"), tmp, tainted=True)
    _publish(api, w, "pairs", load_topology(str(pairs)), tmp, zone="c")
    _publish(api, w, "shared", load_topology("l4-2-pcie"), tmp, shared={0})
    # What takes devices first, allocated by the real scheduler: both L4s of the l4 node and
    # 16Gi of the shared L4.
    _claim(api, ns, "hog", _request("gpu.flexgpu.dev", 2, f'{A}.productName == "NVIDIA L4"'))
    _pod(api, ns, "hog", "hog", _on(w, "l4"))
    _claim(
        api,
        ns,
        "share-hog",
        _request("shared-gpu.flexgpu.dev", capacity={"requests": {"memory": "16Gi"}}),
    )
    _pod(api, ns, "share-hog", "share-hog", _on(w, "shared"))
    for pod in ("hog", "share-hog"):
        wait_for(lambda p=pod: _scheduled(api, ns, p), timeout_s=60, what=f"{pod} scheduled")
    yield w
    core.delete_namespace(ns)
    for publisher in w.publishers:
        publisher.delete_all()
    for node in w.nodes.values():
        core.delete_node(node)


def _install_policy_crd(api: Any) -> None:
    """The GpuNodePolicy CRD, before the controller starts (its watch then finds it at once)."""
    manifest = yaml.safe_load((REPO / "crds" / "flexgpu.dev_gpunodepolicies.yaml").read_text())
    extensions = client.ApiextensionsV1Api(api)
    try:
        extensions.create_custom_resource_definition(manifest)
    except client.ApiException as err:
        if err.status != 409:
            raise
    objects = client.CustomObjectsApi(api)

    def served() -> bool:
        try:
            objects.list_cluster_custom_object(CRD_GROUP, node_policy.VERSION, node_policy.PLURAL)
        except client.ApiException:
            return False
        return True

    wait_for(served, what="gpunodepolicies served")


def _has_default_account(core: Any, ns: str) -> bool:
    try:
        core.read_namespaced_service_account("default", ns)
    except client.ApiException:
        return False
    return True


class ControllerProcess:
    def __init__(self, cluster: ControlPlane, identity: str, lease: str, log: Path) -> None:
        self.identity = identity
        self.log = log
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self._out = log.open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "flexgpu.controller.main",
                f"--kubeconfig={cluster.kubeconfig}",
                "--namespace=default",
                f"--lease-name={lease}",
                f"--identity={identity}",
                "--pending-delay=2",
                "--recheck-interval=1",
                "--metrics-port=0",
                # The webhook has its own tests; its configuration would reach other tests' objects.
                "--no-webhook",
            ],
            cwd=REPO,
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
        )

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self._out.closed:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()


def _holder(api: Any, lease: str) -> str:
    try:
        spec = client.CoordinationV1Api(api).read_namespaced_lease(lease, "default").spec
    except client.ApiException:
        return ""
    return str(spec.holder_identity or "")


@pytest.fixture(scope="module")
def controller(
    cluster: ControlPlane, api: Any, world: World, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ControllerProcess]:
    log = tmp_path_factory.mktemp("ctl-log") / "controller.log"
    lease = f"ctl-{world.run}"
    proc = ControllerProcess(cluster, "solo", lease, log)
    try:
        wait_for(lambda: _holder(api, lease) == "solo", timeout_s=30, what="controller leads")
    except BaseException:
        proc.stop()
        print(log.read_text())
        raise
    yield proc
    proc.stop()


# --- five reasons, each on the pod and on the claim ------------------------------------------

CASES: dict[str, tuple[Any, Any, list[str]]] = {
    # name: (claim request, constraints, phrases the Event must contain)
    "taken": (
        _request("gpu.flexgpu.dev", 1, f'{A}.productName == "NVIDIA L4"'),
        None,
        ["allocated to other claims", "/hog", "0 free"],
    ),
    "too-big": (
        _request("gpu.flexgpu.dev", 1, f'{CAP}.memory.compareTo(quantity("100Gi")) >= 0'),
        None,
        ["None of the", "the largest are", "NVIDIA H100 80GB HBM3 with 79.6Gi"],
    ),
    "elsewhere": (
        _request("gpu.flexgpu.dev", 2, f'{A}.productName.startsWith("NVIDIA H100")'),
        None,
        ["on nodes this pod cannot use", "nodeSelector", "does not match"],
    ),
    "tainted": (
        _request("gpu.flexgpu.dev", 1, f'{A}.productName.startsWith("NVIDIA A100")'),
        None,
        ["tainted flexgpu.dev/maintenance=true:NoSchedule", "not tolerated"],
    ),
    "nvlink": (
        _request("gpu.flexgpu.dev", 3, f'{A}.productName.startsWith("NVIDIA H100")'),
        [{"matchAttribute": f"{DRIVER_NAME}/nvlinkDomain"}],
        ["4 matching devices free", "matchAttribute gpu.flexgpu.dev/nvlinkDomain", "at most 2"],
    ),
    "share": (
        _request("shared-gpu.flexgpu.dev", capacity={"requests": {"memory": "12Gi"}}),
        None,
        ["without enough capacity left beside other shares", "memory", "share-hog"],
    ),
}


def _case_pod_selector(world: World, case: str) -> dict[str, str]:
    if case == "elsewhere":
        # H100s exist only on zone-b and zone-c nodes; this pod may only go to zone a.
        return {RUN_LABEL: world.run, ZONE_LABEL: "a"}
    role = {"taken": "l4", "too-big": "h100", "tainted": "a100", "nvlink": "pairs"}.get(
        case, "shared"
    )
    return _on(world, role)


def test_unsatisfiable_claims_get_events_naming_the_reason(
    api: Any, world: World, controller: ControllerProcess
) -> None:
    ns = world.namespace
    for case, (request, constraints, _) in CASES.items():
        extra = {"constraints": constraints} if constraints else {}
        _claim(api, ns, case, request, **extra)
        _pod(api, ns, case, case, _case_pod_selector(world, case))
    for case, (_, _, phrases) in CASES.items():
        for kind in ("Pod", "ResourceClaim"):
            messages = wait_for(
                lambda c=case, k=kind: _events(api, ns, k, c),
                timeout_s=45,
                what=f"{REASON} Event on {kind} {case}",
            )
            text = messages[0]
            print(f"{kind} {case}: {text}")
            missing = [p for p in phrases if p not in text]
            assert not missing, f"{kind} {case}: {missing} not in {text!r}"
    # Not spammed: the diagnosis does not change, so no second Event per object.
    holds_for(
        lambda: all(len(_events(api, ns, "Pod", case)) == 1 for case in CASES),
        4,
        "four re-diagnoses at --recheck-interval=1, each of which could add a second Event",
    )


def test_no_event_for_a_claim_that_fits(
    api: Any, world: World, controller: ControllerProcess
) -> None:
    ns = world.namespace
    _claim(
        api,
        ns,
        "fits",
        _request("gpu.flexgpu.dev", 1, f'{A}.productName.startsWith("NVIDIA H100")'),
    )
    _pod(api, ns, "fits", "fits", _on(world, "h100"))
    wait_for(lambda: _scheduled(api, ns, "fits"), timeout_s=60, what="fits scheduled")
    holds_for(
        lambda: _events(api, ns, "Pod", "fits") == [],
        4,
        "past --pending-delay=2 plus two passes at --recheck-interval=1, when an Event would be",
    )


def test_a_pod_asking_more_gpus_as_an_extended_resource_than_a_node_has_is_told_why(
    api: Any, world: World, controller: ControllerProcess
) -> None:
    """Nine GPUs through the class's implicit extended resource name, on an 8-GPU node: the
    scheduler makes no claim for a pod it cannot place, so the controller explains the one it
    would make and records the Event on the pod."""
    if target_minor() < 36:
        pytest.skip("extended resources through DRA are beta and on from 1.36")
    ns = world.namespace
    client.CoreV1Api(api).create_namespaced_pod(
        ns,
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "nine"},
            "spec": {
                "nodeSelector": _on(world, "h100"),
                "terminationGracePeriodSeconds": 0,
                "containers": [
                    {
                        "name": "c",
                        "image": "none",
                        "resources": {
                            "limits": {"deviceclass.resource.kubernetes.io/gpu.flexgpu.dev": "9"}
                        },
                    }
                ],
            },
        },
    )
    (text,) = wait_for(
        lambda: _events(api, ns, "Pod", "nine"), timeout_s=45, what=f"{REASON} on pod nine"
    )
    assert text.startswith(
        "The pod's extended resources (deviceclass.resource.kubernetes.io/gpu.flexgpu.dev: 9,"
        " served by DRA) cannot be allocated"
    ), text
    # The world's H100 node publishes some of its GPUs as MIG devices: fewer than eight whole.
    assert re.search(r"no node the pod may use has more than [1-8] of them", text), text


# --- GpuNodePolicy status ------------------------------------------------------------------


def _policy_status(api: Any, name: str) -> dict[str, Any]:
    body = client.CustomObjectsApi(api).get_cluster_custom_object(
        CRD_GROUP, node_policy.VERSION, node_policy.PLURAL, name
    )
    return dict(body.get("status") or {})


def _conflict(status: dict[str, Any]) -> dict[str, Any]:
    return next((c for c in status.get("conditions", []) if c["type"] == "Conflict"), {})


def test_policy_status_matched_nodes_and_conflict(
    api: Any, world: World, controller: ControllerProcess
) -> None:
    objects = client.CustomObjectsApi(api)
    run = world.run
    client.CoreV1Api(api).patch_node(
        world.nodes["pairs"], {"metadata": {"labels": {"ctl.flexgpu.dev/policy": run}}}
    )
    names = {"tie-a": 3, "tie-b": 3, "low": 1}
    for suffix, priority in names.items():
        objects.create_cluster_custom_object(
            CRD_GROUP,
            node_policy.VERSION,
            node_policy.PLURAL,
            {
                "apiVersion": node_policy.API_VERSION,
                "kind": node_policy.KIND,
                "metadata": {"name": f"ctl-{run}-{suffix}"},
                "spec": {
                    "priority": priority,
                    "nodeSelector": {"matchLabels": {"ctl.flexgpu.dev/policy": run}},
                },
            },
        )
    try:
        tie = f"ctl-{run}-tie-a"
        status = wait_for(
            lambda: (s := _policy_status(api, tie)) and _conflict(s).get("status") == "True" and s,
            timeout_s=30,
            what="Conflict=True on the tied policy",
        )
        assert status["matchedNodes"] == [world.nodes["pairs"]]
        message = _conflict(status)["message"]
        assert f"ctl-{run}-tie-a, ctl-{run}-tie-b all select node {world.nodes['pairs']}" in message
        low = wait_for(lambda: _policy_status(api, f"ctl-{run}-low"), what="low policy status")
        assert _conflict(low)["status"] == "False" and low["matchedNodes"] == [world.nodes["pairs"]]
        # The tie resolved: the condition clears.
        objects.delete_cluster_custom_object(
            CRD_GROUP, node_policy.VERSION, node_policy.PLURAL, f"ctl-{run}-tie-b"
        )
        wait_for(
            lambda: _conflict(_policy_status(api, tie)).get("status") == "False",
            timeout_s=30,
            what="Conflict=False once the tie is gone",
        )
    finally:
        for suffix in names:
            try:
                objects.delete_cluster_custom_object(
                    CRD_GROUP, node_policy.VERSION, node_policy.PLURAL, f"ctl-{run}-{suffix}"
                )
            except client.ApiException as err:
                if err.status != 404:
                    raise


# --- the CLI ----------------------------------------------------------------------------------


def _cli(cluster: ControlPlane, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "flexgpu.controller.cli",
            *args,
            f"--kubeconfig={cluster.kubeconfig}",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_flexgpu_explain_and_capacity(cluster: ControlPlane, api: Any, world: World) -> None:
    ns = world.namespace
    _claim(api, ns, "cli-taint", CASES["tainted"][0])
    _pod(api, ns, "cli-taint-pod", "cli-taint", _on(world, "a100"))
    by_pod = _cli(cluster, "explain", f"{ns}/cli-taint-pod")
    assert by_pod.returncode == 3, by_pod.stderr  # blocked: the documented exit status
    assert "tainted flexgpu.dev/maintenance=true:NoSchedule" in by_pod.stdout.replace("\n", " ")
    by_claim = _cli(cluster, "explain", f"{ns}/cli-taint")
    assert by_claim.returncode == 3 and "not tolerated" in by_claim.stdout.replace("\n", " ")
    allocated = _cli(cluster, "explain", f"{ns}/hog")
    assert allocated.returncode == 0, allocated.stderr
    assert f"is allocated on {world.nodes['l4']}" in allocated.stdout.replace("\n", " ")
    missing = _cli(cluster, "explain", f"{ns}/nothing-here")
    assert missing.returncode == 4 and "no ResourceClaim or pod" in missing.stderr

    capacity = _cli(cluster, "capacity", "-o", "json")
    assert capacity.returncode == 0, capacity.stderr
    rows = {(r["type"], r["product"], r["profile"]): r for r in json.loads(capacity.stdout)}
    h100 = rows[("gpu", "NVIDIA H100 80GB HBM3", "")]
    # hgx-h100-8's GPUs 6 and 7 are in MIG mode without instances: never published whole.
    assert h100["total"] >= 10 and h100["free"] <= h100["total"]
    l4 = rows[("gpu", "NVIDIA L4", "")]
    assert l4["total"] >= 3 and l4["total"] - l4["free"] >= 2  # the hog holds two
    shared = rows[("shared", "NVIDIA L4", "")]
    memory = shared["shareable"]["memory"]
    assert memory["free"] != memory["total"]  # share-hog took 16Gi
    table = _cli(cluster, "capacity")
    assert table.returncode == 0 and "NVIDIA H100 80GB HBM3" in table.stdout


# --- two replicas -----------------------------------------------------------------------------


def test_second_replica_takes_over_after_sigkill(
    cluster: ControlPlane, api: Any, world: World, controller: ControllerProcess, tmp_path: Path
) -> None:
    # The module's controller would answer for the new leader; only the pair may run now.
    controller.stop()
    lease = f"ha-{world.run}"
    procs = {
        name: ControllerProcess(cluster, name, lease, tmp_path / f"{name}.log")
        for name in ("one", "two")
    }
    try:
        first = wait_for(lambda: _holder(api, lease), timeout_s=30, what="a leader")
        assert first in procs
        other = next(n for n in procs if n != first)
        # Both running, one leading: the follower must not take the lease from a live leader.
        holds_for(
            lambda: _holder(api, lease) == first,
            2,
            "a few follower retries while the leader renews",
        )
        killed_at = time.monotonic()
        procs[first].stop(signal.SIGKILL)
        wait_for(lambda: _holder(api, lease) == other, timeout_s=25, what=f"{other} takes over")
        takeover_s = time.monotonic() - killed_at
        print(f"takeover after SIGKILL: {takeover_s:.1f}s")
        assert takeover_s <= 20
        # Diagnostics resume under the new leader: a fresh unsatisfiable claim gets its Event.
        ns = world.namespace
        _claim(api, ns, "after-failover", CASES["tainted"][0])
        _pod(api, ns, "after-failover", "after-failover", _on(world, "a100"))
        messages = wait_for(
            lambda: _events(api, ns, "Pod", "after-failover"), timeout_s=30, what="Event"
        )
        assert "not tolerated" in messages[0]
        events = client.CoreV1Api(api).list_namespaced_event(ns).items
        reporters = {
            e.reporting_instance
            for e in events
            if e.reason == REASON and e.involved_object.name == "after-failover"
        }
        assert reporters == {other}
    finally:
        for proc in procs.values():
            proc.stop()
