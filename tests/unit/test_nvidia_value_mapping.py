"""docs/admin.md maps NVIDIA's DRA chart values to flexgpu's: every flexgpu value the table
names exists in the chart's values.yaml, so the mapping cannot point at a renamed value."""

from __future__ import annotations

import re
from typing import Any

import yaml

from tools.cluster.binaries import REPO_ROOT

ADMIN = (REPO_ROOT / "docs" / "admin.md").read_text()
VALUES: dict[str, Any] = yaml.safe_load((REPO_ROOT / "charts/flexgpu/values.yaml").read_text())


def _rows() -> list[list[str]]:
    section = ADMIN.split("### From NVIDIA's chart", 1)[1].split("\n#", 1)[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| `")]
    return [[cell.strip("| ") for cell in row] for row in rows]


def _exists(path: str) -> bool:
    node: Any = VALUES
    for part in path.removesuffix(".*").split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def test_every_flexgpu_value_in_the_mapping_exists() -> None:
    rows = _rows()
    assert len(rows) >= 25
    named = 0
    for row in rows:
        for value in re.findall(r"`([A-Za-z][\w.*]*)`", row[1]):
            if value == "GpuNodePolicy" or value.startswith(("plugins", "/")):
                continue
            named += 1
            assert _exists(value), f"docs/admin.md maps {row[0]} to {value}, not in values.yaml"
    assert named >= 30
