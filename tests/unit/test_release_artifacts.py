"""What can be checked of the release artifacts without a container engine or the forge."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import yaml

from tools.cluster.binaries import REPO_ROOT, helm_tools_dir

CONTAINERFILE = (REPO_ROOT / "Containerfile").read_text()
WORKFLOW = REPO_ROOT / ".github" / "workflows" / "ci.yaml"


def _instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n\s*", " ", CONTAINERFILE)
    lines = [line.strip() for line in joined.splitlines()]
    return [(line.split()[0].upper(), line) for line in lines if line and not line.startswith("#")]


def test_base_image_is_pinned_and_never_latest() -> None:
    for arg in ("PYTHON_IMAGE", "GO_IMAGE"):
        base = re.search(rf"ARG {arg}=(\S+)", CONTAINERFILE)
        assert base is not None, arg
        assert re.search(r":\d+\.\d+\.\d+-", base.group(1)), base.group(1)
    assert ":latest" not in CONTAINERFILE
    froms = [line for kind, line in _instructions() if kind == "FROM"]
    assert froms and all("${PYTHON_IMAGE}" in f or "${GO_IMAGE}" in f for f in froms)


def test_only_copy_of_the_product_and_no_add() -> None:
    kinds = [kind for kind, _ in _instructions()]
    assert "ADD" not in kinds
    copied = {line.split()[1] for kind, line in _instructions() if kind == "COPY"}
    assert copied == {
        "pyproject.toml",
        "driver",
        "kubelet_plugin",
        "controller",
        "flexgpu",  # links the three folders into one namespace
        "tools/nvidia-ctk",  # the pinned NVIDIA Container Toolkit programs
        "--from=toolkit",  # ... built in their own stage
    }


def test_the_image_ships_the_programs_the_plugin_runs() -> None:
    """The plugin runs flexgpu-cdi-common at start and installs nvidia-cdi-hook and
    flexgpu-cdi-hooks for the hooks in its specs (kubelet_plugin/driver_edits.py); all are
    built into the image."""
    for program in ("flexgpu-cdi-common", "nvidia-cdi-hook", "flexgpu-cdi-hooks", "nvidia-ctk"):
        assert f"-o /out/{program}" in CONTAINERFILE
    assert "COPY --from=toolkit /out/ /usr/local/bin/" in CONTAINERFILE


def test_pip_installs_are_cache_free_and_from_built_wheels() -> None:
    runs = [line for kind, line in _instructions() if kind == "RUN" and "pip install" in line]
    assert runs
    assert all("--no-cache-dir" in r and "--no-index" in r for r in runs)
    assert "useradd --system --uid 65532" in CONTAINERFILE


def test_workflow_tests_before_it_releases() -> None:
    flow = yaml.safe_load(WORKFLOW.read_text())
    jobs = flow["jobs"]
    assert any(step.get("run") == "make test" for step in jobs["test"]["steps"])
    assert jobs["release"]["needs"] == "test"
    assert jobs["release"]["if"].startswith("startsWith(github.ref, 'refs/tags/v')")


def test_release_pushes_exactly_the_image_the_chart_defaults_name(tmp_path: Path) -> None:
    flow = yaml.safe_load(WORKFLOW.read_text())
    steps = flow["jobs"]["release"]["steps"]
    (version,) = [s for s in steps if s.get("id") == "version"]
    output = tmp_path / "output"
    subprocess.run(
        ["bash", "-euo", "pipefail", "-c", version["run"]],
        cwd=REPO_ROOT,
        env={**os.environ, "GITHUB_REF_NAME": "v1.2.3", "GITHUB_OUTPUT": str(output)},
        check=True,
    )
    outputs = dict(line.split("=", 1) for line in output.read_text().splitlines())
    # The chart is packaged with appVersion 1.2.3, the default tag: what it then runs is what
    # the workflow pushes (registry and repository as the chart renders them).
    rendered = subprocess.run(
        [
            str(helm_tools_dir() / "helm"),
            "template",
            "t",
            str(REPO_ROOT / "charts/flexgpu"),
            "--set",
            "image.tag=1.2.3",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    daemonset = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "DaemonSet")
    assert outputs["image"] == daemonset["spec"]["template"]["spec"]["containers"][0]["image"]
    assert outputs["image"].startswith("ghcr.io/")
    (push,) = [s for s in steps if str(s.get("uses", "")).startswith("docker/build-push")]
    assert push["with"]["tags"] == "${{ steps.version.outputs.image }}"
    assert push["with"]["file"] == "Containerfile"
    package = next(s["run"] for s in steps if 'helm" package' in str(s.get("run", "")))
    assert '--app-version "$version"' in package
    publish = next(s["run"] for s in steps if "SHA256SUMS" in str(s.get("run", "")))
    assert "sha256sum" in publish and "steps.image.outputs.digest" in publish
