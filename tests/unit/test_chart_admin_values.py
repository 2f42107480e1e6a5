"""Chart values an admin reaches for on a shared cluster: tolerations for the taints GPU node
pools carry."""

from __future__ import annotations

from pathlib import Path

from tests.unit.test_chart import find, helm, render

__all__ = ["helm"]  # the fixture, shared with test_chart.py


def test_plugin_tolerates_the_taints_of_gpu_node_pools(helm: Path) -> None:
    """NVIDIA's and flexgpu's own keys, and AKS's ``sku=gpu`` of GPU node pools."""
    tolerations = find(render(helm), "DaemonSet")["spec"]["template"]["spec"]["tolerations"]
    assert {"key": "sku", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"} in (
        tolerations
    )
    assert {t["key"] for t in tolerations} >= {"nvidia.com/gpu", "flexgpu.dev/gpu", "sku"}
