"""The manifests users copy (demo/ and the pods in docs/) run on a real GPU cluster: their images
are published ones (never a placeholder registry) and their pods tolerate the taint GPU node pools
usually carry, the one the demo's simulated GPU nodes carry too (so `make demo` and its test
prove the tolerations are enough)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from demo.world import GPU_POOL_TAINT
from flexgpu.controller.gpu_tolerations import (
    DEFAULT_GPU_TOLERATIONS,
    pod_uses_flexgpu,
    toleration_patch,
)

ROOT = Path(__file__).resolve().parents[2]
# Images that exist publicly under these names, and what a recipe's command needs from them.
PUBLISHED = {"ubuntu:24.04", "ubuntu:22.04"}


def _docs_objects() -> Iterator[tuple[str, dict[str, Any]]]:
    for page in sorted((ROOT / "docs").glob("*.md")):
        for block in re.findall(r"```yaml\n(.*?)```", page.read_text(), re.DOTALL):
            for doc in yaml.safe_load_all(_dedent(block)):
                if isinstance(doc, dict):
                    yield page.name, doc


def _dedent(block: str) -> str:
    lines = [line for line in block.splitlines() if line.strip()]
    indent = min((len(line) - len(line.lstrip()) for line in lines), default=0)
    return "\n".join(line[indent:] for line in block.splitlines())


def _objects() -> list[tuple[str, dict[str, Any]]]:
    found = [
        (path.name, doc)
        for path in sorted((ROOT / "demo").glob("[0-9][0-9]-*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc
    ]
    return found + list(_docs_objects())


def _pod_specs() -> list[tuple[str, dict[str, Any]]]:
    specs = []
    for source, doc in _objects():
        if doc.get("kind") == "Pod":
            specs.append((f"{source}:{doc['metadata']['name']}", doc["spec"]))
        elif doc.get("kind") in ("Deployment", "Job", "StatefulSet", "DaemonSet"):
            specs.append((f"{source}:{doc['metadata']['name']}", doc["spec"]["template"]["spec"]))
    return specs


def test_every_pod_uses_a_published_image() -> None:
    specs = _pod_specs()
    assert len(specs) >= 19
    for where, spec in specs:
        for container in spec["containers"] + spec.get("initContainers", []):
            assert container["image"] in PUBLISHED, (where, container["image"])


class _Published:
    """The claims, templates and classes the manifests themselves define (and the chart's
    classes), as the controller's pod toleration webhook looks them up."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        classes = yaml.safe_load_all((ROOT / "demo" / "deviceclasses.yaml").read_text())
        for _, doc in [*_objects(), *(("classes", d) for d in classes if d)]:
            if doc.get("kind") in ("ResourceClaim", "ResourceClaimTemplate", "DeviceClass"):
                self.objects[(doc["kind"], doc["metadata"]["name"])] = doc

    def claim_spec(self, namespace: str, name: str) -> dict[str, Any] | None:
        doc = self.objects.get(("ResourceClaim", name))
        return doc["spec"] if doc else None

    def template_claim_spec(self, namespace: str, name: str) -> dict[str, Any] | None:
        doc = self.objects.get(("ResourceClaimTemplate", name))
        return doc["spec"]["spec"] if doc else None

    def device_class_spec(self, name: str) -> dict[str, Any] | None:
        doc = self.objects.get(("DeviceClass", name))
        return doc["spec"] if doc else None


def test_every_pod_tolerates_the_gpu_pool_taint() -> None:
    """Its own toleration, or the one the controller's webhook adds to pods with flexgpu
    claims (the chart's default, applied with the webhook's own code)."""
    published = _Published()
    for where, spec in _pod_specs():
        tolerations = list(spec.get("tolerations", []))
        if pod_uses_flexgpu({"spec": spec}, "default", published):
            added = toleration_patch({"spec": spec}, list(DEFAULT_GPU_TOLERATIONS))
            tolerations += _values(added)
        tolerated = [
            t
            for t in tolerations
            if t["key"] == GPU_POOL_TAINT["key"]
            and t.get("effect") in (None, GPU_POOL_TAINT["effect"])
            and (t.get("operator") == "Exists" or t.get("value") == GPU_POOL_TAINT["value"])
        ]
        assert tolerated, where


def _values(patch: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for op in patch:
        out.extend(op["value"] if isinstance(op["value"], list) else [op["value"]])
    return out
