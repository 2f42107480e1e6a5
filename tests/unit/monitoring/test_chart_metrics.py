"""The chart wires metrics end to end: the plugin gets its port and the idle settings (and
they parse as the plugin parses them), its pods are behind a headless Service, the
controller reads them for idle Events with the same window, and turning the port or the
idle feature off removes every piece of it."""

from __future__ import annotations

import subprocess
from typing import Any

import yaml

from flexgpu.kubelet_plugin.observe.metrics_setup import settings_from_env
from tools.cluster.binaries import REPO_ROOT, helm_tools_dir

CHART = REPO_ROOT / "charts" / "flexgpu"


def render(*values: str) -> list[dict[str, Any]]:
    args = [
        str(helm_tools_dir() / "helm"),
        "template",
        "t",
        str(CHART),
        "-n",
        "gpu",
        "--api-versions",
        "monitoring.coreos.com/v1",
        "--api-versions",
        "cert-manager.io/v1",
    ]
    for value in ("metrics.prometheusRule.enabled=true", *values):
        args += ["--set-json", value]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def plugin_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    container: dict[str, Any] = daemonset["spec"]["template"]["spec"]["containers"][0]
    return container


def controller_args(docs: list[dict[str, Any]]) -> list[str]:
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


def rule_names(docs: list[dict[str, Any]]) -> set[str]:
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    return {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}


def test_default_values_wire_plugin_metrics_and_idle_events() -> None:
    docs = render('metrics.idleClaims.window="90m"', "metrics.idleClaims.utilizationThreshold=0.1")
    container = plugin_container(docs)
    env = {e["name"]: e.get("value") for e in container["env"]}
    settings = settings_from_env({k: v for k, v in env.items() if v is not None})
    assert settings.port == 8082
    assert (settings.usage.idle_window_s, settings.usage.idle_threshold) == (5400, 0.1)
    assert {"name": "metrics", "containerPort": 8082} in container["ports"]
    service = next(d for d in docs if d["metadata"]["name"] == "t-flexgpu-kubelet-plugin-metrics")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "kubelet-plugin"
    args = controller_args(docs)
    assert "--plugin-metrics=t-flexgpu-kubelet-plugin-metrics.gpu.svc:8082" in args
    assert "--idle-window=90m" in args
    assert "FlexgpuClaimIdle" in rule_names(docs)


def test_plugin_port_zero_or_idle_off_removes_the_pieces() -> None:
    docs = render("kubeletPlugin.metricsPort=0", "metrics.serviceMonitor.enabled=true")
    env = {e["name"]: e.get("value") for e in plugin_container(docs)["env"]}
    assert settings_from_env({k: v for k, v in env.items() if v is not None}).port is None
    ports = plugin_container(docs).get("ports", [])
    assert [p["name"] for p in ports] == ["health"]  # the probes' port stays
    assert not [d for d in docs if d["metadata"]["name"].endswith("-kubelet-plugin-metrics")]
    monitors = [d["metadata"]["name"] for d in docs if d["kind"] == "ServiceMonitor"]
    assert monitors == ["t-flexgpu-controller"]
    assert not [a for a in controller_args(docs) if a.startswith("--plugin-metrics")]

    docs = render("metrics.idleClaims.enabled=false")
    names = {e["name"] for e in plugin_container(docs)["env"]}
    assert not names & {"FLEXGPU_IDLE_WINDOW", "FLEXGPU_IDLE_THRESHOLD"}
    assert not [a for a in controller_args(docs) if a.startswith("--idle-window")]
    assert "FlexgpuClaimIdle" not in rule_names(docs)
