"""The chart lets viewers read what flexgpu publishes: one ClusterRole, aggregated into view,
edit and admin, granting read (and nothing else) on ResourceSlices, DeviceClasses and
GpuNodePolicies."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_chart import find, render
from tools.cluster.binaries import helm_tools_dir


@pytest.fixture(scope="module")
def helm() -> Path:
    return helm_tools_dir() / "helm"


def test_viewers_may_read_slices_classes_and_policies_and_nothing_more(helm: Path) -> None:
    role = find(render(helm), "ClusterRole", "-view")
    assert role["metadata"]["name"] == "t-flexgpu-view"
    labels = role["metadata"]["labels"]
    for verb in ("view", "edit", "admin"):
        assert labels[f"rbac.authorization.k8s.io/aggregate-to-{verb}"] == "true"
    granted = {
        (group, resource, tuple(rule["verbs"]))
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    read = ("get", "list", "watch")
    assert granted == {
        ("resource.k8s.io", "resourceslices", read),
        ("resource.k8s.io", "deviceclasses", read),
        ("flexgpu.dev", "gpunodepolicies", read),
    }
