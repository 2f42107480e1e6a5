"""What can be checked of the release artifacts without a container engine or the forge."""

from __future__ import annotations

import re

import yaml

from tools.cluster.binaries import REPO_ROOT

CONTAINERFILE = (REPO_ROOT / "Containerfile").read_text()
WORKFLOW = REPO_ROOT / ".github" / "workflows" / "ci.yaml"


def _instructions() -> list[tuple[str, str]]:
    joined = re.sub(r"\\\n\s*", " ", CONTAINERFILE)
    lines = [line.strip() for line in joined.splitlines()]
    return [(line.split()[0].upper(), line) for line in lines if line and not line.startswith("#")]


def test_base_image_is_pinned_and_never_latest() -> None:
    base = re.search(r"ARG PYTHON_IMAGE=(\S+)", CONTAINERFILE)
    assert base is not None
    assert re.search(r":\d+\.\d+\.\d+-", base.group(1)), base.group(1)
    assert ":latest" not in CONTAINERFILE
    froms = [line for kind, line in _instructions() if kind == "FROM"]
    assert froms and all("${PYTHON_IMAGE}" in line for line in froms)


def test_only_copy_of_the_product_and_no_add() -> None:
    kinds = [kind for kind, _ in _instructions()]
    assert "ADD" not in kinds
    copied = {line.split()[1] for kind, line in _instructions() if kind == "COPY"}
    assert copied == {"pyproject.toml", "driver", "kubelet_plugin", "controller"}


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
