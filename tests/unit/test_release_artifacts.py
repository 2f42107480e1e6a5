"""What can be checked of the release workflow without the forge: it tests before it
releases, builds the image with the recipe the tests run (release/; contents and
reproducibility: tests/integration/test_release_image.py), pushes it with the push the
real-node tests use (release/push.py) and names the image the chart's defaults pull."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

from tools.cluster.binaries import REPO_ROOT, helm_tools_dir

WORKFLOW = REPO_ROOT / ".github" / "workflows" / "ci.yaml"


def _release_steps() -> list[dict[str, Any]]:
    steps: list[dict[str, Any]] = yaml.safe_load(WORKFLOW.read_text())["jobs"]["release"]["steps"]
    return steps


def test_one_recipe_no_container_engine_and_no_second_image_definition() -> None:
    """No Containerfile/Dockerfile to drift from the tested image, no Docker action: the
    release runs the recipe `make node` runs for the tests and pushes that archive."""
    for name in ("Containerfile", "Dockerfile"):
        assert not (REPO_ROOT / name).exists(), name
    steps = _release_steps()
    assert not any(str(s.get("uses", "")).startswith("docker/") for s in steps)
    build = next(s for s in steps if s.get("id") == "image")["run"]
    assert "-m release.image" in build
    # make node builds every image the tests run, the flexgpu one through release.image.
    assert "-m tools.images.build" in (REPO_ROOT / "Makefile").read_text()
    assert (
        "from release.image import flexgpu_image"
        in (REPO_ROOT / "tools" / "images" / "build.py").read_text()
    )
    push = next(s for s in steps if s.get("id") == "push")["run"]
    assert '-m release.push "${{ steps.image.outputs.archive }}"' in push
    assert '"${{ steps.version.outputs.image }}"' in push
    # Debian 12's packages are the image's Python: the job runs where apt gives them.
    job = yaml.safe_load(WORKFLOW.read_text())["jobs"]["release"]
    assert job["container"] == "debian:12"
    # A bare Debian container: what the later steps run must be installed first.
    install = steps[0]["run"]
    for package in ("git", "make", "gcc", "libc6-dev", "python3-venv", "ca-certificates", "gh"):
        assert f" {package}" in install, package


def test_workflow_tests_before_it_releases() -> None:
    flow = yaml.safe_load(WORKFLOW.read_text())
    jobs = flow["jobs"]
    assert any(step.get("run") == "make test" for step in jobs["test"]["steps"])
    assert jobs["release"]["needs"] == "test"
    assert jobs["release"]["if"].startswith("startsWith(github.ref, 'refs/tags/v')")


def test_release_pushes_exactly_the_image_the_chart_defaults_name(tmp_path: Path) -> None:
    steps = _release_steps()
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
    package = next(s["run"] for s in steps if 'helm" package' in str(s.get("run", "")))
    assert '--app-version "$version"' in package
    publish = next(s["run"] for s in steps if "SHA256SUMS" in str(s.get("run", "")))
    assert "sha256sum" in publish and "steps.push.outputs.digest" in publish
    # The release carries the pushed archive itself and what decided its digest.
    assert "steps.image.outputs.archive" in publish and "image-inputs.txt" in publish


def test_the_release_builds_one_index_for_amd64_and_arm64_with_its_inputs() -> None:
    """GPU nodes are amd64 and arm64 (GH200, GB200): the release pushes one image index over
    both, and lists what decided both halves."""
    build = next(s for s in _release_steps() if s.get("id") == "image")["run"]
    assert "platforms=linux/amd64,linux/arm64" in build
    commands = [line for line in build.splitlines() if "-m release.image" in line]
    assert len(commands) == 2 and all('--platforms "$platforms"' in c for c in commands)
    assert any("--inputs" in c for c in commands)
    setup = _release_steps()[0]["run"]
    assert "gcc-aarch64-linux-gnu" in setup and "libc6-dev-arm64-cross" in setup
