"""GPU usage seen by a real Prometheus: Debian's prometheus binary, with its own config and
data folder on a loopback port, scrapes the kubelet plugin and the controller of the test
world and evaluates the chart's own rules (idle window shortened to 10 s). One claim's GPU
is kept busy through the simulated node's usage file, the other's stays idle: the idle
alert fires for the idle claim only, the controller tells the idle claim and its pod,
`flexgpu usage` reports both claims from Prometheus and from the plugin, and every panel of
the chart's Grafana dashboard returns series."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from flexgpu.driver.sim_usage import USAGE_FILE_NAME
from tests.conftest import wait_for
from tests.integration.gpu_workloads import (
    allocated,
    create_claim,
    ensure_device_classes,
    gpu_request,
    make_pod,
    wait_phase,
)
from tests.promtool import check_metrics
from tools.cluster import ControlPlane
from tools.cluster.binaries import REPO_ROOT, helm_tools_dir
from tools.cluster.control_plane import free_port
from tools.cluster.gpu_node import SimulatedGpuNode
from tools.cluster.process import Component

pytestmark = pytest.mark.integration

NODE = "usage-l4"
WINDOW = "10s"
DASHBOARD = REPO_ROOT / "charts" / "flexgpu" / "dashboards" / "flexgpu-usage.json"


@dataclass
class World:
    namespace: str
    node: SimulatedGpuNode
    plugin_port: int
    controller_port: int
    prometheus: str  # base URL


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def query(world: World, promql: str) -> list[dict[str, Any]]:
    body = _get(f"{world.prometheus}/api/v1/query?{urllib.parse.urlencode({'query': promql})}")
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def _rules(tmp: Path) -> Path:
    helm = helm_tools_dir() / "helm"
    chart = str(REPO_ROOT / "charts" / "flexgpu")
    values = ["metrics.prometheusRule.enabled=true", f"metrics.idleClaims.window={WINDOW}"]
    out = subprocess.run(
        [
            str(helm),
            "template",
            "t",
            chart,
            "-n",
            "flexgpu",
            "--api-versions",
            "monitoring.coreos.com/v1",
            *(f"--set={v}" for v in values),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rule = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "PrometheusRule")
    path = tmp / "rules.yaml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    return path


def _prometheus(tmp: Path, targets: dict[str, int]) -> tuple[Component, str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(
            "the prometheus binary is missing: `make test` installs it (tools/system-deps.sh test)"
        )
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(_rules(tmp))],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
            for job, port in targets.items()
        ],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    component = Component(
        "prometheus",
        [
            binary,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1h",
        ],
        tmp / "prometheus.log",
    )
    component.start()
    base = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if not component.running():
            pytest.fail(f"prometheus exited: {component.log_tail()}")
        try:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    wait_for(ready, timeout_s=60, what="prometheus ready")
    return component, base


def _load(node: SimulatedGpuNode, busy: dict[int, int]) -> None:
    """Processes on the busy GPUs (index -> SM percent); the others run nothing."""
    gpus = {
        str(index): {
            "processes": [{"pid": 40000 + index, "usedMemoryMiB": 2048, "smUtilization": percent}]
        }
        for index, percent in busy.items()
    }
    path = node.data_dir / USAGE_FILE_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"gpus": gpus}))
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def world(
    cluster: ControlPlane, api: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    ensure_device_classes(api)
    tmp = tmp_path_factory.mktemp("usage")
    plugin_port, controller_port = free_port(), free_port()
    node = SimulatedGpuNode(
        cluster.kubeconfig,
        NODE,
        "l4-2-pcie",
        plugin_env={
            **os.environ,
            "FLEXGPU_METRICS_PORT": str(plugin_port),
            "FLEXGPU_METRICS_ADDRESS": "127.0.0.1",
            "FLEXGPU_USAGE_INTERVAL": "1",
            "FLEXGPU_IDLE_WINDOW": WINDOW,
        },
    )
    core = client.CoreV1Api(api)
    namespace = f"usage-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": namespace}})
    wait_for(
        lambda: core.list_namespaced_service_account(namespace).items,
        what="default ServiceAccount",
    )
    controller = Component(
        "flexgpu-controller",
        [
            sys.executable,
            "-m",
            "flexgpu.controller.main",
            f"--kubeconfig={cluster.kubeconfig}",
            "--namespace=default",
            f"--lease-name=usage-{namespace}",
            "--identity=usage",
            f"--metrics-port={controller_port}",
            "--metrics-address=127.0.0.1",
            "--no-webhook",
            f"--plugin-metrics=127.0.0.1:{plugin_port}",
            f"--idle-window={WINDOW}",
            "--idle-check-interval=1",
        ],
        tmp / "controller.log",
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    prometheus: Component | None = None
    try:
        node.start()
        _load(node, {})
        for name in ("busy", "idle"):
            create_claim(api, namespace, name, {"requests": [gpu_request()]})
            core.create_namespaced_pod(
                namespace,
                make_pod(f"{name}-pod", "sleep 600", {"g": {"resourceClaimName": name}}, NODE),
            )
        for name in ("busy", "idle"):
            wait_phase(api, namespace, f"{name}-pod", {"Running"})
        (busy,) = allocated(api, namespace, "busy")
        _load(node, {int(busy.device.removeprefix("gpu-")): 85})
        controller.start()
        prometheus, base = _prometheus(
            tmp,
            {"flexgpu-kubelet-plugin": plugin_port, "flexgpu-controller": controller_port},
        )
        yield World(namespace, node, plugin_port, controller_port, base)
    finally:
        if prometheus is not None:
            prometheus.stop()
        controller.stop()
        node.cleanup()
        core.delete_namespace(namespace)


def _alerts(world: World, name: str) -> list[dict[str, Any]]:
    alerts: list[dict[str, Any]] = _get(f"{world.prometheus}/api/v1/alerts")["data"]["alerts"]
    return [a for a in alerts if a["labels"].get("alertname") == name]


def test_prometheus_scrapes_both_daemons(world: World) -> None:
    def up() -> set[str]:
        return {r["metric"]["job"] for r in query(world, "up == 1")}

    assert wait_for(
        lambda: up() >= {"flexgpu-kubelet-plugin", "flexgpu-controller"},
        timeout_s=60,
        what="both targets up",
    )
    # What the running daemons serve passes promtool as it is.
    for port in (world.plugin_port, world.controller_port):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            check_metrics(r.read())
    ns = world.namespace
    claims = wait_for(
        lambda: (
            {
                r["metric"]["claim"]: r
                for r in query(world, f'flexgpu_claim_allocated_gpus{{namespace="{ns}"}}')
            }
            or None
        ),
        timeout_s=60,
        what="per-claim series",
    )
    assert set(claims) == {"busy", "idle"}
    assert {claims[c]["metric"]["pods"] for c in claims} == {"busy-pod", "idle-pod"}
    assert all(r["metric"]["class"] == "gpu.flexgpu.dev" for r in claims.values())


def test_idle_alert_fires_for_the_idle_claim_and_not_the_busy_one(world: World) -> None:
    ns = world.namespace

    def firing() -> list[dict[str, Any]]:
        return [
            a
            for a in _alerts(world, "FlexgpuClaimIdle")
            if a["state"] == "firing" and a["labels"]["namespace"] == ns
        ]

    alerts = wait_for(firing, timeout_s=120, what="FlexgpuClaimIdle firing")
    assert [a["labels"]["claim"] for a in alerts] == ["idle"]
    # The busy claim has been measured for longer than the window, and stays out.
    measured = query(
        world,
        f"count_over_time(flexgpu_claim_sm_utilization_ratio"
        f'{{namespace="{ns}",claim="busy"}}[30s])',
    )
    assert measured and float(measured[0]["value"][1]) >= 10
    assert not [
        a
        for a in _alerts(world, "FlexgpuClaimIdle")
        if a["labels"].get("claim") == "busy" and a["labels"].get("namespace") == ns
    ]
    busy = query(world, f'flexgpu_claim_sm_utilization_ratio{{namespace="{ns}",claim="busy"}}')
    assert float(busy[0]["value"][1]) == 0.85


def test_controller_tells_the_idle_claim_and_its_pod(world: World, api: Any) -> None:
    core = client.CoreV1Api(api)

    def idle_events() -> set[tuple[str, str]]:
        events = core.list_namespaced_event(world.namespace).items
        return {
            (e.involved_object.kind, e.involved_object.name)
            for e in events
            if e.reason == "IdleGpuClaim"
        }

    told = wait_for(
        lambda: idle_events() >= {("ResourceClaim", "idle"), ("Pod", "idle-pod")} and idle_events(),
        timeout_s=120,
        what="IdleGpuClaim Events",
    )
    assert ("ResourceClaim", "busy") not in told and ("Pod", "busy-pod") not in told


def _usage(*args: str) -> Any:
    result = subprocess.run(
        [sys.executable, "-m", "flexgpu.controller.cli", "usage", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_flexgpu_usage_from_prometheus_and_from_the_plugin(world: World) -> None:
    ns = world.namespace
    wait_for(lambda: _alerts(world, "FlexgpuClaimIdle"), timeout_s=120, what="idle claim")
    report = json.loads(
        _usage(
            "--prometheus",
            world.prometheus,
            "--range",
            "1m",
            "--idle-window",
            WINDOW,
            "-n",
            ns,
            "-o",
            "json",
        )
    )
    claims = {c["claim"]: c for c in report["claims"]}
    assert set(claims) == {"busy", "idle"}
    assert claims["busy"]["usedGpuHours"] > 0 and claims["idle"]["usedGpuHours"] == 0
    assert claims["idle"]["allocatedGpuHours"] > 0
    assert [i["claim"] for i in report["idleClaims"]] == ["idle"]
    (row,) = report["namespaces"]
    assert (row["deviceClass"], row["product"]) == ("gpu.flexgpu.dev", "NVIDIA L4")

    direct = yaml.safe_load(
        _usage(
            "--plugin",
            f"127.0.0.1:{world.plugin_port}",
            "--idle-window",
            WINDOW,
            "-n",
            ns,
            "-o",
            "yaml",
        )
    )
    assert {c["claim"] for c in direct["claims"]} == {"busy", "idle"}
    assert [i["claim"] for i in direct["idleClaims"]] == ["idle"]
    table = _usage(
        "--plugin",
        f"127.0.0.1:{world.plugin_port}",
        "-n",
        ns,
        "-o",
        "wide",
        "--idle-window",
        WINDOW,
    )
    assert "busy" in table and "Idle claims:" in table


def _exported(world: World) -> set[str]:
    names: set[str] = set()
    for port in (world.plugin_port, world.controller_port):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("# TYPE "):
                    name, kind = line.split()[2:4]
                    names.add(name)
                    if kind in ("counter", "histogram"):
                        names |= {f"{name}_total", f"{name}_bucket", f"{name}_count", f"{name}_sum"}
    return names


def test_every_dashboard_panel_returns_series(world: World) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = _exported(world)
    # Grafana's own variables, as it would fill them for a short range.
    fill = {"$__range": "1m", "$__rate_interval": "15s", "$__interval": "5s"}
    wait_for(lambda: _alerts(world, "FlexgpuClaimIdle"), timeout_s=120, what="idle claim")
    empty = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name in re.findall(r"\bflexgpu_[a-z_]+", expr):
                assert name in exported, f"{panel['title']}: {name} is not exported"
            for variable, value in fill.items():
                expr = expr.replace(variable, value)
            if not query(world, expr):
                empty.append(f"{panel['title']}: {expr}")
    assert not empty, empty
