"""The chart's Grafana dashboard: shipped only when asked, in a ConfigMap the Grafana sidecar
picks up, valid JSON whose every panel queries the Prometheus datasource variable, and every
query parses as PromQL (checked by promtool as recording rules). That each query returns
series is proven against a live Prometheus in tests/integration/test_usage_prometheus.py."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tests.promtool import promtool_path
from tools.cluster.binaries import REPO_ROOT, helm_tools_dir

CHART = REPO_ROOT / "charts" / "flexgpu"
GRAFANA_VARIABLES = {"$__range": "1h", "$__rate_interval": "1m", "$__interval": "30s"}


def render(*values: str) -> list[dict[str, Any]]:
    args = [str(helm_tools_dir() / "helm"), "template", "t", str(CHART), "-n", "monitoring"]
    for value in values:
        args += ["--set", value]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def dashboard_maps(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")
    ]


def test_dashboard_is_off_by_default_and_labelled_for_the_sidecar() -> None:
    assert dashboard_maps(render()) == []
    (config_map,) = dashboard_maps(
        render("metrics.grafanaDashboard.enabled=true", "metrics.grafanaDashboard.namespace=g")
    )
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "g"
    shipped = json.loads(config_map["data"]["flexgpu-usage.json"])
    assert shipped == json.loads((CHART / "dashboards" / "flexgpu-usage.json").read_text())


def test_every_panel_query_parses(tmp_path: Path) -> None:
    dashboard = json.loads((CHART / "dashboards" / "flexgpu-usage.json").read_text())
    titles = [p["title"] for p in dashboard["panels"]]
    assert len(titles) == len(set(titles))
    rules = []
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            assert "$" not in expr, f"{panel['title']}: unfilled variable in {expr}"
            assert re.search(r"\bflexgpu_", expr), panel["title"]
            rules.append({"record": f"panel:{len(rules)}", "expr": expr})
    (tmp_path / "panels.yaml").write_text(
        yaml.safe_dump({"groups": [{"name": "p", "rules": rules}]})
    )
    result = subprocess.run(
        [promtool_path(), "check", "rules", str(tmp_path / "panels.yaml")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
