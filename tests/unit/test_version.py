"""The version is written once and stamped into every place that shows it."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from release import stamp_version

ROOT = Path(__file__).resolve().parents[2]


def test_every_place_agrees_today() -> None:
    found = stamp_version.current()
    assert len(set(found.values())) == 1, found


def test_stamp_rewrites_the_package_and_the_chart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    version_file = tmp_path / "version.py"
    chart = tmp_path / "Chart.yaml"
    shutil.copy(stamp_version.VERSION_FILE, version_file)
    shutil.copy(stamp_version.CHART_FILE, chart)
    monkeypatch.setattr(stamp_version, "VERSION_FILE", version_file)
    monkeypatch.setattr(stamp_version, "CHART_FILE", chart)
    assert stamp_version.main(["2.3.4-rc.1"]) == 0
    assert set(stamp_version.current().values()) == {"2.3.4-rc.1"}
    assert stamp_version.main(["--check"]) == 0


@pytest.mark.parametrize("bad", ["v1.2.3", "1.2", "1.2.3.4", "01.2.3", "1.2.3 "])
def test_stamp_refuses_what_is_not_a_semantic_version(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = stamp_version.current()
    assert stamp_version.main([bad]) == 2
    err = capsys.readouterr().err
    assert repr(bad) in err and "allowed: a semantic version" in err
    assert stamp_version.current() == before


def test_the_cli_reports_the_source_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "flexgpu.controller.cli", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == f"flexgpu {stamp_version.current()['driver/version.py']}"


@pytest.mark.timeout(300)
def test_the_wheel_carries_the_version_and_the_license(tmp_path: Path) -> None:
    # Built from a copy: setuptools writes build/ and *.egg-info into the tree it builds.
    source = tmp_path / "source"
    shutil.copytree(
        ROOT,
        source,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", ".run", "build", "*.egg-info", "__pycache__", ".*_cache"
        ),
    )
    out = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("flexgpu-*.whl")
    version = stamp_version.current()["driver/version.py"]
    assert wheel.name.startswith(f"flexgpu-{version}-")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode()
    assert "License-Expression: Apache-2.0" in text
    # The plugin serves gRPC with grpcio (the design's choice); grpclib is gone.
    requires = [line for line in text.splitlines() if line.startswith("Requires-Dist:")]
    runtime = [r for r in requires if "extra ==" not in r]
    assert any(r.startswith("Requires-Dist: grpcio") for r in runtime), requires
    assert not any(r.startswith("Requires-Dist: grpclib") for r in requires), requires
    assert any(n.endswith("licenses/LICENSE") for n in names)
    # One namespace installed: nothing that could collide with another project's `driver`.
    top_level = {n.split("/")[0] for n in names if not n.startswith(f"flexgpu-{version}")}
    assert top_level == {"flexgpu"}, top_level
    for package in ("driver", "kubelet_plugin", "controller"):
        assert f"flexgpu/{package}/__init__.py" in names
    assert "flexgpu/driver/topologies/h200-4.yaml" in names
    assert "flexgpu/kubelet_plugin/kubeletplugin/proto/gen/dra/v1/dra_pb2.py" in names
    # Only what shipped code uses: the plugin serves from descriptors, so the gRPC client
    # stubs (tests' and tools') stay out.
    assert not [n for n in names if "_pb2_grpc" in n or "/grpc_stubs/" in n]
    # Every third-party package that shipped code imports is a declared dependency.
    declared = {
        re.split(r"[<>=!~; \[]", r.removeprefix("Requires-Dist: "), maxsplit=1)[0]
        .lower()
        .replace("_", "-")
        for r in runtime
    }
    imported = _third_party_imports(ROOT / "driver", ROOT / "kubelet_plugin", ROOT / "controller")
    distributions = importlib.metadata.packages_distributions()
    undeclared = {
        module: dists
        for module, dists in ((m, distributions.get(m, [m])) for m in imported)
        if not any(d.lower().replace("_", "-") in declared for d in dists)
    }
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def _third_party_imports(*roots: Path) -> set[str]:
    """Top-level names of the modules imported by the .py files under roots, less the
    standard library and flexgpu itself."""
    names: set[str] = set()
    for root in roots:
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Import):
                    names.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"flexgpu", "__future__"}
