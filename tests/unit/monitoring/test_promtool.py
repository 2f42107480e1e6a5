"""The chart's rules pass ``promtool check rules``, and their unit tests (rules_test.yaml:
rollouts, Xids, a GPU gone, idle claims) pass ``promtool test rules``. (Both daemons' /metrics
text is checked with ``promtool check metrics`` beside their other metrics tests.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.promtool import promtool_path
from tools.cluster.binaries import REPO_ROOT, helm_tools_dir

HERE = Path(__file__).resolve().parent
CHART = REPO_ROOT / "charts" / "flexgpu"


@pytest.fixture(scope="module")
def promtool() -> str:
    return promtool_path()


def rendered_rules(*values: str) -> dict[str, Any]:
    args = [
        str(helm_tools_dir() / "helm"),
        "template",
        "t",
        str(CHART),
        "-n",
        "flexgpu-system",
        "--api-versions",
        "monitoring.coreos.com/v1",
        "--api-versions",
        "cert-manager.io/v1",
    ]
    for value in ("metrics.prometheusRule.enabled=true", *values):
        args += ["--set", value]
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    rule = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "PrometheusRule")
    spec: dict[str, Any] = rule["spec"]
    return spec


def test_chart_rules_pass_promtool_check_and_their_unit_tests(
    promtool: str, tmp_path: Path
) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rendered_rules()))
    shutil.copy(HERE / "rules_test.yaml", tmp_path / "rules_test.yaml")
    check = subprocess.run(
        [promtool, "check", "rules", "rules.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    test = subprocess.run(
        [promtool, "test", "rules", "rules_test.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert test.returncode == 0, test.stdout + test.stderr
    assert "SUCCESS" in test.stdout
