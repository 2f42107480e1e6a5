"""Quickstart manifests applied to the real node as a user applies them (``kubectl apply``), each
container's own output and its report from inside, and the comparison of two drivers' runs:
shared by the node tests of NVIDIA's quickstart (test_nvidia_quickstart_node.py,
test_nvidia_quickstart_mig_node.py)."""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.conftest import wait_for
from tests.node.nvidia_node import differences, documented, reduce
from tests.nvidia_plugin import nvidia_binary
from tools.cluster.binaries import helm_tools_dir
from tools.images.build import HERE as IMAGES_DIR
from tools.node import report
from tools.node.node import RealNode
from tools.nvidia_twin.quickstart import documents, nvidia_specs

START, END = "<!-- nvidia-quickstart-node:start -->", "<!-- nvidia-quickstart-node:end -->"
# The report script, once, as the image's bash runs it (unexported, so the report's
# environment is the container's own).
REPORT = "REPORT_ONCE=1\n" + (IMAGES_DIR / "report.sh").read_text(encoding="utf-8")
# How the comparison names a difference every container of a manifest shows.
EVERY = "every container"


def quickstart_specs() -> Path:
    """NVIDIA's quickstart folder; skips without the Go toolchain (building NVIDIA's plugin
    fetched the module's source)."""
    nvidia_binary()
    return nvidia_specs()


@dataclass
class Container:
    node: str
    image: str
    log: str
    report: report.Report


@dataclass
class Run:
    """One manifest as one driver ran it."""

    containers: dict[str, Container]  # "pod/container" ->
    reserved: dict[str, list[str]]  # ResourceClaim -> the pods it was reserved for


Runs = dict[str, dict[str, Run]]  # driver label -> manifest ->


def kubectl(node: RealNode, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(helm_tools_dir() / "kubectl"), f"--kubeconfig={node.cluster.kubeconfig}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if check and proc.returncode != 0:
        pytest.fail(f"kubectl {' '.join(args)} failed (exit {proc.returncode}): {proc.stderr}")
    return proc


def apply(node: RealNode, paths: list[Path], namespaces: list[str]) -> None:
    """``kubectl apply`` of the manifests. A pod created in the same breath as its namespace
    can be refused until the controller made the namespace's default ServiceAccount; as a user
    would, apply again once it exists (apply leaves what already exists as it is)."""
    args = ["apply", *(a for p in paths for a in ("-f", str(p)))]
    if kubectl(node, *args, check=False).returncode == 0:
        return
    core: Any = client.CoreV1Api(node.api)

    def accounts() -> bool:
        try:
            for namespace in namespaces:
                core.read_namespaced_service_account("default", namespace)
        except client.ApiException as err:
            if err.status != 404:
                raise
            return False
        return True

    wait_for(accounts, timeout_s=60, what=f"default ServiceAccounts of {namespaces}")
    kubectl(node, *args)


def namespace_of(path: Path) -> str:
    return str(next(d["metadata"]["name"] for d in documents(path) if d["kind"] == "Namespace"))


def pod_count(path: Path) -> int:
    """The pods the manifest makes: its Pods and its Deployments' replicas."""
    docs = documents(path)
    pods = sum(1 for d in docs if d["kind"] == "Pod")
    return pods + sum(int(d["spec"]["replicas"]) for d in docs if d["kind"] == "Deployment")


def pod_keys(pods: list[Any]) -> dict[str, str]:
    """Pod name -> how the comparison names it: a Pod the manifest names by its name, a
    Deployment's replicas (random names) as ``replica<i>`` in name order, so two runs pair up."""
    replicas = sorted(p.metadata.name for p in pods if p.metadata.owner_references)
    keys = {p.metadata.name: p.metadata.name for p in pods if not p.metadata.owner_references}
    return keys | {name: f"replica{i}" for i, name in enumerate(replicas)}


def report_from_inside(node: RealNode, container_id: str) -> report.Report:
    """The report script run in the container through the runtime (``ctr tasks exec``): the
    process gets the container's environment, namespaces and device cgroup."""
    out = node.ctr(
        "tasks",
        "exec",
        "--exec-id",
        f"report-{secrets.token_hex(4)}",
        container_id.removeprefix("containerd://"),
        "bash",
        "-c",
        REPORT,
        timeout_s=60,
    )
    found = report.parse(out)
    assert found, f"container {container_id}: no report; it printed:\n{out[-2000:]}"
    return found[0]


def _all_running(api: Any, namespaces: dict[str, int]) -> list[Any] | None:
    core: Any = client.CoreV1Api(api)
    pods: list[Any] = []
    for namespace, count in namespaces.items():
        found = core.list_namespaced_pod(namespace).items
        for pod in found:
            if pod.status.phase in ("Failed", "Succeeded"):
                pytest.fail(f"{namespace}/{pod.metadata.name} ended {pod.status.phase}")
        statuses = [s for p in found for s in p.status.container_statuses or []]
        if len(found) != count or not statuses or not all(s.state.running for s in statuses):
            return None
        pods += found
    return pods


def _output(node: RealNode, namespace: str, pod: str, container: str) -> str:
    """The container's log once its first command printed (the runtime writes it
    asynchronously)."""
    log: str = wait_for(
        lambda: node.container_log(namespace, pod, container),
        timeout_s=30,
        what=f"output of {namespace}/{pod}/{container}",
    )
    return log


def run_manifests(node: RealNode, paths: list[Path]) -> dict[str, Run]:
    """Applies the manifests, waits until every container runs, reads each container's output
    and report, then deletes the manifests' namespaces and waits until they are gone (every
    claim unprepared)."""
    api = node.api
    namespaces = {namespace_of(p): pod_count(p) for p in paths}
    manifest = {namespace_of(p): p.stem for p in paths}
    apply(node, paths, list(namespaces))
    try:
        try:
            pods = wait_for(
                lambda: _all_running(api, namespaces),
                timeout_s=180,
                interval_s=0.3,
                what=f"every container of {sorted(namespaces)} running",
            )
        except pytest.fail.Exception:
            events = [
                f"{e.involved_object.name}: {e.reason}: {e.message}"
                for ns in namespaces
                for e in client.CoreV1Api(api).list_namespaced_event(ns).items
            ]
            pytest.fail(f"the manifests' pods did not all run; events: {events[-10:]}")
        runs = {p.stem: Run({}, {}) for p in paths}
        keys = {
            (ns, name): key
            for ns in namespaces
            for name, key in pod_keys([p for p in pods if p.metadata.namespace == ns]).items()
        }
        for pod in pods:
            run = runs[manifest[pod.metadata.namespace]]
            key = keys[(pod.metadata.namespace, pod.metadata.name)]
            for status in pod.status.container_statuses:
                run.containers[f"{key}/{status.name}"] = Container(
                    node=pod.spec.node_name,
                    image=status.image,
                    log=_output(node, pod.metadata.namespace, pod.metadata.name, status.name),
                    report=report_from_inside(node, status.container_id),
                )
        resource: Any = client.ResourceV1Api(api)
        for namespace in namespaces:
            for claim in resource.list_namespaced_resource_claim(namespace).items:
                pods_of = sorted(keys[(namespace, r.name)] for r in claim.status.reserved_for or [])
                runs[manifest[namespace]].reserved[claim.metadata.name] = pods_of
        return runs
    finally:
        _delete(node, list(namespaces))


def _delete(node: RealNode, namespaces: list[str]) -> None:
    kubectl(node, "delete", "namespace", *namespaces, "--wait=false", "--ignore-not-found")
    core: Any = client.CoreV1Api(node.api)

    def gone() -> bool:
        left = {n.metadata.name for n in core.list_namespace().items}
        return not left & set(namespaces)

    wait_for(gone, timeout_s=180, interval_s=0.5, what=f"namespaces {sorted(namespaces)} gone")


def scheduling_failures(node: RealNode, path: Path) -> list[str]:
    """Applies a manifest whose pods the scheduler is expected to refuse; returns the
    FailedScheduling messages of its first pod once there is one, and deletes its namespace."""
    namespace = namespace_of(path)
    apply(node, [path], [namespace])
    core: Any = client.CoreV1Api(node.api)

    def refused() -> list[str]:
        events = core.list_namespaced_event(namespace).items
        return [e.message for e in events if e.reason == "FailedScheduling"]

    try:
        found: list[str] = wait_for(
            refused, timeout_s=60, interval_s=0.5, what=f"{path.stem}'s pods refused"
        )
        running = [
            p.metadata.name for p in core.list_namespaced_pod(namespace).items if p.spec.node_name
        ]
        assert not running, f"{path.stem}: pods {running} were scheduled"
        return found
    finally:
        _delete(node, [namespace])


def undocumented(runs: Runs, manifests: tuple[str, ...]) -> str:
    """Compares each container of NVIDIA's run with the same container of flexgpu's, for the
    rows of the table in docs/nvidia-differential.md that concern ``manifests``: a row names
    the manifest, what differs, each driver's value and the containers it differs in (``every
    container`` when it is all of them). Returns what is wrong (unlisted, stale, no reason),
    with the measured rows to paste; ``""`` when the table is right."""
    found: dict[tuple[str, str, str, str], set[str]] = {}
    for name in manifests:
        theirs, ours = runs["nvidia"][name].containers, runs["flexgpu"][name].containers
        if theirs.keys() != ours.keys():
            return f"{name}: NVIDIA's containers {sorted(theirs)}, flexgpu's {sorted(ours)}"
        for where in theirs:
            pair = reduce(theirs[where].report), reduce(ours[where].report)
            for seen, a, b in differences(*pair):
                found.setdefault((name, seen, a, b), set()).add(where)
    measured = {
        (
            *key,
            EVERY
            if len(where) == len(runs["nvidia"][key[0]].containers)
            else ", ".join(sorted(where)),
        )
        for key, where in found.items()
    }
    listed = {k: v for k, v in documented(START, END, cells=6).items() if k[0] in manifests}
    unlisted = sorted(measured - listed.keys())
    stale = sorted(listed.keys() - measured)
    table = "\n".join(f"| {m} | {k} | `{a}` | `{b}` | {w} | |" for m, k, a, b, w in unlisted)
    reasonless = sorted(row for row in measured & listed.keys() if not listed[row])
    if unlisted or stale or reasonless:
        return f"unlisted:\n{table}\nstale: {stale}\nwithout a reason: {reasonless}"
    return ""
