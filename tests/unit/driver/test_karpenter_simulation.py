"""Karpenter's own scheduling simulation takes flexgpu's templates: Karpenter's DRA allocator
(``sigs.k8s.io/karpenter`` v1.15, ``pkg/scheduling/dynamicresources``, run by karpenter-check
of tools/karpenter on an in-flight node of one instance type) places whole-GPU, NVLink-set,
MIG-profile and fractional claims on a new node whose DynamicResources are
``flexgpu node-template --format karpenter``'s, and refuses what the node could not serve:
more GPUs than it has, more partitions than the counters allow, a selector on a runtime-only
value. The first run builds the tool (Go, Karpenter's dependencies: many minutes cold)."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from flexgpu.driver.autoscaler_shapes import karpenter_dynamic_resources
from flexgpu.driver.names import DRIVER_NAME
from flexgpu.driver.node_template import TemplatePolicy, render_node_template
from flexgpu.driver.topology import load_topology
from tools import buildcache

REPO = Path(__file__).resolve().parents[3]
# hgx-h100-8: GPUs 0-3 whole, 4-5 shared, 6-7 on demand MIG (whole GPU or 7 1g partitions).
POLICY = TemplatePolicy(shared=frozenset({4, 5}), dynamic_mig=frozenset({6, 7}))


@functools.cache
def karpenter_check() -> Path:
    if shutil.which("go") is None:
        pytest.skip("the Go toolchain is needed to build tools/karpenter (karpenter-check)")
    return buildcache.path("karpenter", "karpenter-check", timeout=3600) / "karpenter-check"


def request(name: str, device_class: str, count: int = 1, **extra: Any) -> dict[str, Any]:
    # As the API server stores it: allocationMode and count defaulted.
    exactly = {"deviceClassName": device_class, "allocationMode": "ExactCount", "count": count}
    return {"name": name, "exactly": {**exactly, **extra}}


def claim(name: str, *requests: dict[str, Any], **devices: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": list(requests), **devices}},
    }


def cel(expression: str) -> list[dict[str, Any]]:
    return [{"cel": {"expression": expression}}]


PROFILE_1G = cel(f'device.attributes["{DRIVER_NAME}"].profile == "1g.10gb"')
NVLINK = [{"requests": ["gpus"], "matchAttribute": f"{DRIVER_NAME}/nvlinkDomain"}]
CLAIMS = {
    "one-gpu": (True, claim("one-gpu", request("gpu", "gpu.flexgpu.dev"))),
    # 0-3 and the on-demand MIG GPUs 6-7 as whole GPUs: six in all.
    "six-gpus": (True, claim("six-gpus", request("gpus", "gpu.flexgpu.dev", count=6))),
    "seven-gpus": (False, claim("seven-gpus", request("gpus", "gpu.flexgpu.dev", count=7))),
    "four-gpus-one-nvlink-domain": (
        True,
        claim(
            "four-gpus-one-nvlink-domain",
            request("gpus", "gpu.flexgpu.dev", count=4),
            constraints=NVLINK,
        ),
    ),
    "mig-1g": (True, claim("mig-1g", request("mig", "mig.flexgpu.dev", selectors=PROFILE_1G))),
    # Seven 1g partitions per GPU: the counters stop the fifteenth.
    "fourteen-1g": (
        True,
        claim("fourteen-1g", request("mig", "mig.flexgpu.dev", count=14, selectors=PROFILE_1G)),
    ),
    "fifteen-1g": (
        False,
        claim("fifteen-1g", request("mig", "mig.flexgpu.dev", count=15, selectors=PROFILE_1G)),
    ),
    "share-20gi": (
        True,
        claim(
            "share-20gi",
            request("share", "shared-gpu.flexgpu.dev", capacity={"requests": {"memory": "20Gi"}}),
        ),
    ),
    # A runtime-only value is not in the template: no new node is promised for it.
    "by-uuid": (
        False,
        claim(
            "by-uuid",
            request(
                "gpu",
                "gpu.flexgpu.dev",
                selectors=cel(f'device.attributes["{DRIVER_NAME}"].uuid == "GPU-1"'),
            ),
        ),
    ),
}


def test_karpenter_places_what_the_template_node_serves_and_nothing_more(tmp_path: Path) -> None:
    template = render_node_template(load_topology("hgx-h100-8"), POLICY)
    templates = tmp_path / "templates.json"
    templates.write_text(json.dumps(karpenter_dynamic_resources(template)))
    classes = tmp_path / "classes.json"
    documents = yaml.safe_load_all((REPO / "demo" / "deviceclasses.yaml").read_text())
    classes.write_text(json.dumps(list(documents)))
    claims = tmp_path / "claims.json"
    claims.write_text(json.dumps([body for _, body in CLAIMS.values()]))

    result = subprocess.run(
        [
            str(karpenter_check()),
            f"--templates={templates}",
            f"--classes={classes}",
            f"--claims={claims}",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    verdicts = {line.split(" ", 1)[0]: line for line in result.stdout.splitlines()}
    assert set(verdicts) == set(CLAIMS)
    wrong = [
        verdicts[name]
        for name, (expected, _) in CLAIMS.items()
        if verdicts[name].split(" ", 1)[1].startswith("allocatable") != expected
    ]
    assert not wrong, "\n".join(wrong)
    # What Karpenter picked is what the node offers for each claim.
    picked = {
        name: line.split(": ", 1)[1].split()
        for name, line in verdicts.items()
        if " allocatable: " in line
    }
    assert len(picked["four-gpus-one-nvlink-domain"]) == 4
    assert sorted(picked["six-gpus"]) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-6", "gpu-7"]
    assert len(set(picked["fourteen-1g"])) == 14
    assert all("-mig-1g10gb-" in d for d in picked["fourteen-1g"])
    assert picked["share-20gi"][0] in {"gpu-4", "gpu-5"}
