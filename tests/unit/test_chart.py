"""The Helm chart lints, renders with every option, refuses bad values, ships the CRDs the
code generates, and gives each component only what it needs."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tools.cluster.binaries import REPO_ROOT, helm_tools_dir

CHART = REPO_ROOT / "charts" / "flexgpu"


@pytest.fixture(scope="module")
def helm() -> Path:
    return helm_tools_dir() / "helm"


def render(helm: Path, *values: str) -> list[dict[str, Any]]:
    args = [str(helm), "template", "t", str(CHART), "--namespace", "flexgpu-system"]
    for value in values:
        args += ["--set", value]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def find(docs: list[dict[str, Any]], kind: str, name_part: str = "") -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == kind and name_part in d["metadata"]["name"])


def test_lint_passes(helm: Path) -> None:
    result = subprocess.run(
        [str(helm), "lint", str(CHART)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_option_renders(helm: Path) -> None:
    docs = render(
        helm,
        "metrics.serviceMonitor.enabled=true",
        "metrics.prometheusRule.enabled=true",
        "webhook.certManager.enabled=true",
        "deviceClasses.gpuExtendedResourceName=nvidia.com/gpu",
    )
    kinds = {d["kind"] for d in docs}
    assert {"ServiceMonitor", "PrometheusRule", "Certificate", "Issuer"} <= kinds
    assert find(docs, "DeviceClass", "gpu.flexgpu.dev")["spec"]["extendedResourceName"] == (
        "nvidia.com/gpu"
    )
    args = find(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--webhook-cert-dir=/etc/flexgpu/webhook-tls" in args


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("kubeletPlugin.gpuBackend=cuda", "value must be one of 'nvml', 'simulated'"),
        ("kubeletPlugin.sharedGpus=some", "/kubeletPlugin/sharedGpus"),
        ("controller.replicas=0", "/controller/replicas"),
        ("kubeletPlugin.healthIntervalSeconds=45", "/kubeletPlugin/healthIntervalSeconds"),
        ("unknown=1", "additional properties 'unknown' not allowed"),
    ],
)
def test_bad_values_fail_with_a_clear_message(helm: Path, value: str, message: str) -> None:
    result = subprocess.run(
        [str(helm), "template", "t", str(CHART), "--set", value],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode != 0
    assert message in result.stderr


def test_chart_ships_the_generated_crds() -> None:
    for crd in (REPO_ROOT / "crds").glob("*.yaml"):
        assert (CHART / "crds" / crd.name).read_text() == crd.read_text(), crd.name


def test_device_classes_match_the_demo_catalog(helm: Path) -> None:
    rendered = {
        d["metadata"]["name"]: d["spec"] for d in render(helm) if d["kind"] == "DeviceClass"
    }
    demo = {
        d["metadata"]["name"]: d["spec"]
        for d in yaml.safe_load_all((REPO_ROOT / "demo" / "deviceclasses.yaml").read_text())
        if d
    }
    assert rendered == demo


def test_plugin_is_least_privilege_and_rolls_without_a_gap(helm: Path) -> None:
    docs = render(helm)
    role = find(docs, "ClusterRole", "kubelet-plugin")
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert "secrets" not in resources and "pods" not in resources
    writes = {
        r
        for rule in role["rules"]
        for r in rule["resources"]
        if set(rule["verbs"]) & {"create", "update", "delete"}
    }
    assert writes == {"resourceslices", "resourceclaims/status"}
    # Events: only in namespace default (where Events about Nodes go), and the admission
    # policy limits them to the plugin's own Node.
    events = find(docs, "Role", "kubelet-plugin-node-events")
    assert events["metadata"]["namespace"] == "default"
    assert events["rules"] == [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
    strategy = find(docs, "DaemonSet")["spec"]["updateStrategy"]["rollingUpdate"]
    assert strategy == {"maxSurge": 1, "maxUnavailable": 0}
    env = find(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {
        "name": "FLEXGPU_POD_UID",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}},
    } in env
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    for suffix in ("own-node-slices", "own-node-policy-status", "own-node-events"):
        policy = policies[f"t-flexgpu-kubelet-plugin-{suffix}"]
        assert "t-flexgpu-kubelet-plugin" in policy["spec"]["matchConditions"][0]["expression"]
        bindings = [
            d
            for d in docs
            if d["kind"] == "ValidatingAdmissionPolicyBinding"
            and d["spec"]["policyName"] == policy["metadata"]["name"]
        ]
        assert [b["spec"]["validationActions"] for b in bindings] == [["Deny"]]


def test_controller_writes_only_its_own_webhook_configuration(helm: Path) -> None:
    docs = render(helm)
    role = find(docs, "ClusterRole", "controller")
    rules = [r for r in role["rules"] if "validatingwebhookconfigurations" in r["resources"]]
    named = [r for r in rules if r.get("resourceNames")]
    unnamed = [r for r in rules if not r.get("resourceNames")]
    assert [r["resourceNames"] for r in named] == [["t-flexgpu-validation"]]
    assert {v for r in named for v in r["verbs"]} == {"get", "update", "patch"}
    # create cannot be limited by name in RBAC: the admission policy limits it.
    assert [r["verbs"] for r in unnamed] == [["create"]]
    policy = find(docs, "ValidatingAdmissionPolicy", "controller-own-webhook-configuration")
    assert "t-flexgpu-validation" in policy["spec"]["validations"][0]["expression"]
    args = find(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--webhook-configuration-name=t-flexgpu-validation" in args
    # Without the webhook, no right to any webhook configuration at all.
    off = render(helm, "webhook.enabled=false")
    role_off = find(off, "ClusterRole", "controller")
    assert not any("validatingwebhookconfigurations" in r["resources"] for r in role_off["rules"])
    assert not any(
        d["kind"] == "ValidatingAdmissionPolicy" and "controller" in d["metadata"]["name"]
        for d in off
    )
