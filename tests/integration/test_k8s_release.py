"""The control plane a run starts is the release it targets (FLEXGPU_K8S, default the one
tools/k8s/go.mod pins), with every DRA gate that release lets us set switched on, and the
kubelet harness is built from the same release."""

from __future__ import annotations

import pytest

from tests.conftest import target_minor
from tools.cluster import ControlPlane, binaries
from tools.cluster.feature_gates import WANTED, settable_gates

pytestmark = pytest.mark.integration


def test_control_plane_is_the_targeted_release(cluster: ControlPlane) -> None:
    assert cluster.version.startswith(f"Kubernetes v1.{target_minor()}."), cluster.version


def test_every_settable_wanted_gate_is_on(cluster: ControlPlane) -> None:
    folder = binaries.control_plane_dir()
    listed = set(settable_gates(folder / "kube-apiserver")) & set(
        settable_gates(folder / "kube-scheduler")
    )
    enabled = {g.split("=")[0] for g in cluster.feature_gates.split(",") if g}
    assert enabled == {g for g in WANTED if g in listed}


def test_harness_is_built_from_the_same_release(cluster: ControlPlane) -> None:
    # A kubelet newer than its API server is outside the version skew policy.
    harness = binaries.harness_binary()
    assert harness.parent.name.startswith(f"k8s-v1.{target_minor()}."), harness
