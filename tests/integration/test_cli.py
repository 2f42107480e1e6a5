"""``flexgpu explain`` and ``capacity`` against a real control plane and a harness node, as an
admin and as a namespace user, and as ``kubectl flexgpu``.

Each pod stands for one way a claim is held up: it runs; it cannot be allocated; the node's
plugin refuses to prepare it (the kubelet's FailedPrepareDynamicResources Event carries the
plugin's message); its ResourceClaimTemplate does not exist; it was bound to a node without
the scheduler. The exit status says blocked (3) or not (0), as docs/cli.md documents.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from tests.conftest import wait_for
from tests.integration.conftest import running_gpu_node
from tests.integration.gpu_workloads import (
    REPO,
    create_claim,
    gpu_request,
    make_pod,
    wait_phase,
)
from tools.cluster import ControlPlane
from tools.cluster.binaries import helm_tools_dir
from tools.cluster.gpu_node import SimulatedGpuNode
from tools.cluster.tokens import service_account_kubeconfig

pytestmark = pytest.mark.integration

NODE = "cli-node"
API = "gpu.flexgpu.dev/v1alpha1"
RELEASE = "cli"


@pytest.fixture(scope="module")
def node(cluster: ControlPlane, api: Any) -> Iterator[SimulatedGpuNode]:
    with running_gpu_node(cluster, api, NODE, "l4-2-pcie") as sim:
        yield sim


def flexgpu(
    kubeconfig: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flexgpu.controller.cli", *args, f"--kubeconfig={kubeconfig}"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def flat(text: str) -> str:
    return " ".join(text.split())


def mps_claim(api: Any, namespace: str, name: str, per_device: dict[str, str]) -> None:
    parameters = {
        "apiVersion": API,
        "kind": "GpuConfig",
        "sharing": {
            "strategy": "MPS",
            "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": per_device},
        },
    }
    create_claim(
        api,
        namespace,
        name,
        {
            "requests": [gpu_request()],
            "config": [{"opaque": {"driver": "gpu.flexgpu.dev", "parameters": parameters}}],
        },
    )


def pod(api: Any, namespace: str, name: str, ref: dict[str, str], **spec: Any) -> None:
    body = make_pod(name, "sleep 600", {"gpu": ref}, NODE)
    body["spec"].update(spec)
    client.CoreV1Api(api).create_namespaced_pod(namespace, body)


def pod_event(api: Any, namespace: str, name: str, reason: str) -> str:
    def found() -> str:
        for e in client.CoreV1Api(api).list_namespaced_event(namespace).items:
            if e.involved_object.name == name and e.reason == reason:
                return str(e.message)
        return ""

    return str(wait_for(found, timeout_s=60, what=f"{reason} Event on pod {name}"))


def test_explain_names_what_holds_each_pod_and_exits_accordingly(
    cluster: ControlPlane, api: Any, namespace: str, node: SimulatedGpuNode
) -> None:
    kc = cluster.kubeconfig
    ns = namespace
    create_claim(api, ns, "fits", {"requests": [gpu_request()]})
    pod(api, ns, "runs", {"resourceClaimName": "fits"})
    wait_phase(api, ns, "runs", {"Running"})
    running = flexgpu(kc, "explain", "pod/runs", "-n", ns)
    assert running.returncode == 0, running.stderr
    assert f"Claim {ns}/fits is allocated on {NODE}" in flat(running.stdout)

    create_claim(api, ns, "three", {"requests": [gpu_request(count=3)]})
    pod(api, ns, "too-many", {"resourceClaimName": "three"})
    blocked = flexgpu(kc, "explain", "too-many", "-n", ns)
    assert blocked.returncode == 3, blocked.stderr
    assert "cannot be allocated" in flat(blocked.stdout)

    # Admission cannot know device names before allocation; the plugin refuses at prepare.
    mps_claim(api, ns, "bad-key", {"gpu-9": "4Gi"})
    pod(api, ns, "prep-fails", {"resourceClaimName": "bad-key"})
    pod_event(api, ns, "prep-fails", "FailedPrepareDynamicResources")
    failed = flexgpu(kc, "explain", "pod/prep-fails", "-n", ns, "-o", "json")
    assert failed.returncode == 3, failed.stderr
    doc = json.loads(failed.stdout)
    (finding,) = doc["claims"]
    assert doc["satisfied"] is False and finding["state"] == "PrepareFailed"
    assert 'key "gpu-9" matches no device of the claim' in finding["message"]

    pod(api, ns, "no-template", {"resourceClaimTemplateName": "missing-template"})
    pod_event(api, ns, "no-template", "FailedResourceClaimCreation")
    missing = flexgpu(kc, "explain", "pod/no-template", "-n", ns)
    assert missing.returncode == 3, missing.stderr
    text = flat(missing.stdout)
    assert "ResourceClaimTemplate missing-template, which does not exist" in text
    assert "not made yet" not in text

    create_claim(api, ns, "unscheduled", {"requests": [gpu_request()]})
    body = make_pod("bound", "sleep 600", {"gpu": {"resourceClaimName": "unscheduled"}})
    body["spec"]["nodeName"] = NODE
    client.CoreV1Api(api).create_namespaced_pod(ns, body)
    bound = flexgpu(kc, "explain", "pod/bound", "-n", ns, "-o", "yaml")
    assert bound.returncode == 3, bound.stderr
    assert yaml.safe_load(bound.stdout)["claims"][0]["state"] == "NotScheduled"

    # No name: every waiting pod of the namespace; -A: of every namespace.
    waiting = flexgpu(kc, "explain", "-n", ns)
    assert waiting.returncode == 3, waiting.stderr
    heads = [line for line in waiting.stdout.splitlines() if line.startswith("pod ")]
    assert heads == [f"pod {ns}/{p}:" for p in ("bound", "no-template", "prep-fails", "too-many")]
    everywhere = json.loads(flexgpu(kc, "explain", "-A", "-o", "json").stdout)["pods"]
    mine = {p["name"]: p["satisfied"] for p in everywhere if p["namespace"] == ns}
    assert mine == {"bound": False, "no-template": False, "prep-fails": False, "too-many": False}
    assert flexgpu(kc, "explain", "-A", "pod/runs").returncode == 2

    nothing = flexgpu(kc, "explain", "pod/nothing-here", "-n", ns)
    assert nothing.returncode == 4
    assert nothing.stderr == f"flexgpu: no pod nothing-here in namespace {ns}\n"


def _apply_chart_view_role(api: Any) -> str:
    """The chart's aggregated ClusterRole, as `helm template` renders it."""
    out = subprocess.run(
        [
            str(helm_tools_dir() / "helm"),
            "template",
            RELEASE,
            str(REPO / "charts" / "flexgpu"),
            "--show-only",
            "templates/rbac-aggregate.yaml",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    role = yaml.safe_load(out)
    rbac = client.RbacAuthorizationV1Api(api)
    try:
        rbac.create_cluster_role(role)
    except client.ApiException as err:
        if err.status != 409:
            raise
    return str(role["metadata"]["name"])


def test_a_namespace_user_with_the_aggregated_view_role_can_explain(
    cluster: ControlPlane, api: Any, namespace: str, node: SimulatedGpuNode, tmp_path: Path
) -> None:
    ns = namespace
    role = _apply_chart_view_role(api)
    rbac = client.RbacAuthorizationV1Api(api)

    def aggregated() -> bool:
        rules = rbac.read_cluster_role("view").rules or []
        return any("resourceslices" in (r.resources or []) for r in rules)

    wait_for(aggregated, what="the chart's rules aggregated into ClusterRole view")

    core = client.CoreV1Api(api)
    core.create_namespaced_service_account(ns, {"metadata": {"name": "alice"}})
    subject = [{"kind": "ServiceAccount", "name": "alice", "namespace": ns}]
    ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole"}
    # Alice may view her namespace: the usual namespace user.
    rbac.create_namespaced_role_binding(
        ns,
        {
            "metadata": {"name": "alice-view"},
            "subjects": subject,
            "roleRef": {**ref, "name": "view"},
        },
    )
    kubeconfig = service_account_kubeconfig(api, cluster.kubeconfig, ns, "alice", tmp_path / "kc")
    # Her context names her namespace, so -n is not needed.
    config = yaml.safe_load(kubeconfig.read_text())
    config["contexts"][0]["context"]["namespace"] = ns
    kubeconfig.write_text(yaml.safe_dump(config))

    create_claim(api, ns, "three", {"requests": [gpu_request(count=3)]})
    pod(api, ns, "too-many", {"resourceClaimName": "three"})

    # A RoleBinding cannot grant cluster-scoped reads: one line that says what is missing.
    denied = flexgpu(kubeconfig, "explain", "too-many")
    assert denied.returncode == 1 and denied.stdout == ""
    assert denied.stderr.count("\n") == 1
    assert denied.stderr.startswith("flexgpu: cannot list ResourceSlices: forbidden")
    assert "docs/cli.md" in denied.stderr

    crb = f"alice-{ns}"
    rbac.create_cluster_role_binding(
        {"metadata": {"name": crb}, "subjects": subject, "roleRef": {**ref, "name": role}}
    )
    try:

        def explained() -> subprocess.CompletedProcess[str] | None:
            result = flexgpu(kubeconfig, "explain", "too-many")
            return result if result.returncode != 1 else None

        result = wait_for(explained, timeout_s=30, what="explain as alice once bound")
        assert result.returncode == 3, result.stderr
        text = flat(result.stdout)
        assert "cannot be allocated" in text
        assert "Claims of other namespaces are not visible to you" in text
        assert "Nodes are not visible to you" in text
        capacity = flexgpu(kubeconfig, "capacity", "-o", "json")
        assert capacity.returncode == 0, capacity.stderr
        rows = {(r["type"], r["product"]): r for r in json.loads(capacity.stdout)}
        assert rows[("gpu", "NVIDIA L4")]["total"] >= 2
        wide = flexgpu(kubeconfig, "capacity", "-o", "wide")
        assert wide.returncode == 0, wide.stderr
        lines = wide.stdout.splitlines()
        assert lines[0].split()[:2] == ["NODE", "TYPE"]
        assert any(line.split()[:3] == [NODE, "gpu", "NVIDIA"] for line in lines)
    finally:
        rbac.delete_cluster_role_binding(crb)


def test_kubectl_runs_it_as_a_plugin(cluster: ControlPlane, tmp_path: Path) -> None:
    """kubectl finds kubectl-flexgpu on PATH; the launcher is what the wheel's entry point
    (pyproject [project.scripts]) installs, and exit statuses pass through."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["kubectl-flexgpu"].partition(":")
    launcher = tmp_path / "bin" / "kubectl-flexgpu"
    launcher.parent.mkdir()
    launcher.write_text(
        f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(REPO)!r})\n"
        f"from {module} import {function}\nsys.exit({function}())\n"
    )
    launcher.chmod(0o755)
    kubectl = helm_tools_dir() / "kubectl"
    env = {**os.environ, "PATH": f"{launcher.parent}{os.pathsep}{os.environ['PATH']}"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(kubectl), "flexgpu", *args], env=env, capture_output=True, text=True, check=False
        )

    version = run("--version")
    assert version.returncode == 0 and version.stdout.startswith("flexgpu ")
    missing = run("explain", "pod/absent", "-n", "default", f"--kubeconfig={cluster.kubeconfig}")
    assert missing.returncode == 4, missing.stderr
    assert shutil.which("kubectl-flexgpu", path=env["PATH"]) == str(launcher)
