"""NVIDIA's quickstart manifests on the real node: gpu-test1, gpu-test2 and gpu-test3 of
NVIDIA's DRA driver v0.4.1, applied with kubectl byte for byte as NVIDIA publishes them (read
from the module's source in the Go module cache) while NVIDIA's plugin runs on the node, then
flexgpu's copies of them (tests/integration/nvidia_quickstart: only the driver's names
changed, checked here) against flexgpu's chart-installed plugin. Their containers run
``bash -c "nvidia-smi -L; ...; sleep 9999 & wait"`` in ``ubuntu:22.04``, which the node knows
as the Debian stand-in tools/images builds under that name (no public registry is reachable).

For each container: its own output (the driver's ``nvidia-smi``, which only the CDI edits put
there), what it received from inside (the report script of tools/images run in it through the
runtime: environment, device nodes and whether they open, driver files, mounts), and whether
the manifest does what NVIDIA's quickstart says (gpu-test1: two pods, distinct GPUs; gpu-test2:
two containers of one pod, one GPU; gpu-test3: two pods sharing one claim's GPU). What differs
between the drivers is listed with its reason in docs/nvidia-differential.md ("NVIDIA's
quickstart manifests on the real node"); an unlisted or stale difference fails."""

from __future__ import annotations

import secrets
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.conftest import wait_for
from tests.node.conftest import NODE
from tests.node.nvidia_node import differences, documented, nvidia_plugin, reduce
from tests.node.support import assert_control_nodes_usable
from tests.nvidia_plugin import nvidia_binary
from tools.cluster.binaries import helm_tools_dir
from tools.images.build import HERE as IMAGES_DIR
from tools.images.build import UBUNTU_STANDIN
from tools.node import report
from tools.node.node import RealNode
from tools.nvidia_twin.quickstart import FLEXGPU_COPIES, documents, name_changes, nvidia_specs

pytestmark = pytest.mark.integration

MANIFESTS = ("gpu-test1", "gpu-test2", "gpu-test3")
LABELS = ("nvidia", "flexgpu")
START, END = "<!-- nvidia-quickstart-node:start -->", "<!-- nvidia-quickstart-node:end -->"
# What the simulated driver's nvidia-smi answers to `-L` (tools/node/driver_root.py): the
# program the driver root installs, found on the container's PATH only through the CDI edits.
DRIVER_SMI = "nvidia-smi: simulated NVIDIA driver"
# The report script, once, as the image's bash runs it (unexported, so the report's
# environment is the container's own).
REPORT = "REPORT_ONCE=1\n" + (IMAGES_DIR / "report.sh").read_text(encoding="utf-8")


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
    return sum(1 for d in documents(path) if d["kind"] == "Pod")


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
        for pod in pods:
            run = runs[manifest[pod.metadata.namespace]]
            for status in pod.status.container_statuses:
                run.containers[f"{pod.metadata.name}/{status.name}"] = Container(
                    node=pod.spec.node_name,
                    image=status.image,
                    log=_output(node, pod.metadata.namespace, pod.metadata.name, status.name),
                    report=report_from_inside(node, status.container_id),
                )
        resource: Any = client.ResourceV1Api(api)
        for namespace in namespaces:
            for claim in resource.list_namespaced_resource_claim(namespace).items:
                pods_of = sorted(r.name for r in claim.status.reserved_for or [])
                runs[manifest[namespace]].reserved[claim.metadata.name] = pods_of
        return runs
    finally:
        kubectl(node, "delete", "namespace", *namespaces, "--wait=false", "--ignore-not-found")

        def gone() -> bool:
            core: Any = client.CoreV1Api(api)
            left = {n.metadata.name for n in core.list_namespace().items}
            return not left & namespaces.keys()

        wait_for(gone, timeout_s=180, interval_s=0.5, what=f"namespaces {sorted(namespaces)} gone")


@pytest.fixture(scope="module")
def specs() -> Path:
    nvidia_binary()  # skips without the Go toolchain; its build fetched the module's source
    return nvidia_specs()


@pytest.fixture(scope="module")
def runs(plugin: RealNode, specs: Path, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    folder = Path(tmp_path_factory.mktemp("nvquickstart-node"))
    with nvidia_plugin(plugin, folder, mig_layouts=False) as component:
        try:
            nvidia = run_manifests(plugin, [specs / f"{m}.yaml" for m in MANIFESTS])
        except BaseException:
            print(component.log_tail(60))
            raise
        flexgpu = run_manifests(plugin, [FLEXGPU_COPIES / f"{m}.yaml" for m in MANIFESTS])
    return {"nvidia": nvidia, "flexgpu": flexgpu}


def test_flexgpu_copies_change_only_the_drivers_names(specs: Path) -> None:
    """Every quickstart manifest flexgpu keeps a copy of equals NVIDIA's once NVIDIA's class,
    attribute domain, driver and apiVersion names are renamed; comments aside."""
    copies = sorted(FLEXGPU_COPIES.glob("gpu-test*.yaml"))
    assert {p.stem for p in copies} >= set(MANIFESTS)
    for copy in copies:
        assert name_changes(specs / copy.name, copy) == [], copy.name


def test_containers_run_the_standin_image_on_the_real_node(runs: Runs) -> None:
    for label, by_manifest in runs.items():
        for name, run in by_manifest.items():
            for where, seen in run.containers.items():
                assert seen.node == NODE, f"{label} {name} {where} ran on {seen.node}"
                assert seen.image == UBUNTU_STANDIN, f"{label} {name} {where}: {seen.image}"


def test_each_container_ran_the_drivers_nvidia_smi(runs: Runs) -> None:
    """`nvidia-smi -L`, the manifests' first command, is not in the image: it runs only where
    the driver's CDI edits mounted the driver root's program, which answers that no GPU is
    here. The container's devices are checked from inside instead (the tests below)."""
    for label, by_manifest in runs.items():
        for name, run in by_manifest.items():
            for where, seen in run.containers.items():
                assert DRIVER_SMI in seen.log, f"{label} {name} {where}: {seen.log[-500:]}"
                assert "/usr/bin/nvidia-smi" in seen.report.files, (label, name, where)
                assert_control_nodes_usable(seen.report)


def _gpus(run: Run) -> dict[str, list[str]]:
    """Per container, its GPU device nodes; each must open (its device cgroup allows it)."""
    found = {}
    for where, seen in run.containers.items():
        nodes = seen.report.gpu_nodes()
        assert all(seen.report.devices[p].cgroup_allows for p in nodes), (where, nodes)
        found[where] = nodes
    return found


@pytest.mark.parametrize("label", LABELS)
def test_gpu_test1_gives_each_pod_its_own_gpu(runs: Runs, label: str) -> None:
    run = runs[label]["gpu-test1"]
    gpus = _gpus(run)
    assert sorted(gpus) == ["pod1/ctr", "pod2/ctr"]
    assert all(len(nodes) == 1 for nodes in gpus.values()), gpus
    assert gpus["pod1/ctr"] != gpus["pod2/ctr"], f"both pods got {gpus['pod1/ctr']}"
    assert sorted(run.reserved.values()) == [["pod1"], ["pod2"]], run.reserved


@pytest.mark.parametrize("label", LABELS)
def test_gpu_test2_containers_of_one_pod_share_one_gpu(runs: Runs, label: str) -> None:
    run = runs[label]["gpu-test2"]
    gpus = _gpus(run)
    assert sorted(gpus) == ["pod/ctr0", "pod/ctr1"]
    assert len(gpus["pod/ctr0"]) == 1 and gpus["pod/ctr0"] == gpus["pod/ctr1"], gpus
    assert list(run.reserved.values()) == [["pod"]], run.reserved


@pytest.mark.parametrize("label", LABELS)
def test_gpu_test3_pods_share_the_claims_gpu(runs: Runs, label: str) -> None:
    run = runs[label]["gpu-test3"]
    gpus = _gpus(run)
    assert sorted(gpus) == ["pod1/ctr", "pod2/ctr"]
    assert len(gpus["pod1/ctr"]) == 1 and gpus["pod1/ctr"] == gpus["pod2/ctr"], gpus
    assert run.reserved == {"single-gpu": ["pod1", "pod2"]}


def test_containers_differ_only_where_documented(runs: Runs) -> None:
    """Each container of NVIDIA's run is compared with the same container of flexgpu's; a row
    of the table names the manifest, what differs and the containers it differs in."""
    found: dict[tuple[str, str, str, str], set[str]] = {}
    for name in MANIFESTS:
        theirs, ours = runs["nvidia"][name].containers, runs["flexgpu"][name].containers
        assert theirs.keys() == ours.keys(), name
        for where in theirs:
            pair = reduce(theirs[where].report), reduce(ours[where].report)
            for seen, a, b in differences(*pair):
                found.setdefault((name, seen, a, b), set()).add(where)
    measured = {(*key, ", ".join(sorted(where))) for key, where in found.items()}
    listed = documented(START, END, cells=6)
    unlisted = sorted(measured - listed.keys())
    stale = sorted(listed.keys() - measured)
    table = "\n".join(f"| {m} | {k} | `{a}` | `{b}` | {w} | |" for m, k, a, b, w in unlisted)
    assert not unlisted and not stale, f"unlisted:\n{table}\nstale: {stale}"
    for row in measured:
        assert listed[row], f"{row}: the table must give the reason for the difference"
