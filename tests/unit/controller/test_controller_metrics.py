"""Pool figures per node and kind, shared capacity, pending claims; the exported families."""

from __future__ import annotations

from fractions import Fraction

from controller_builders import NOW, claim, holding, node, node_slices, pod, request, snapshot
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from flexgpu.controller import metrics
from flexgpu.controller.metrics import PoolCollector, PoolFigures, pool_figures
from tests.promtool import check_metrics


def _figures() -> PoolFigures:
    snap = snapshot(
        slices=node_slices("l4", "l4-2-pcie") + node_slices("s", "l4-2-pcie", shared=(0,)),
        nodes=[node("l4"), node("s")],
        claims=[
            holding("hog", "l4", "gpu-0"),
            holding("share", "s", "gpu-0", memory="16Gi", compute="50"),
            claim("waiting", request()),
        ],
        pods=[pod("old", "waiting", age_s=300)],
    )
    return pool_figures(snap, NOW, unsatisfiable=1)


def test_devices_and_shares_per_node() -> None:
    figures = _figures()
    rows = {(r.node, r.type): r for r in figures.devices}
    l4 = rows[("l4", "gpu")]
    assert (l4.total, l4.allocated, l4.free, l4.product) == (2, 1, 1, "NVIDIA L4")
    assert (rows[("s", "gpu")].free, rows[("s", "shared")].allocated) == (1, 1)
    shared = {s.resource: s for s in figures.shared}
    assert shared["memory"].granted == Fraction(16 * 2**30)
    assert shared["compute"].granted == 50 and shared["compute"].free == 50


def test_pending_figures_and_exposition() -> None:
    figures = _figures()
    assert figures.pending == 1 and figures.oldest_pending_s == 300
    collector = PoolCollector()
    registry = CollectorRegistry()
    registry.register(collector)
    assert b"flexgpu_devices_published{" not in generate_latest(registry)
    collector.update(figures)
    text = generate_latest(registry).decode()
    assert 'flexgpu_devices_free{node="l4",product="NVIDIA L4",profile="",type="gpu"} 1.0' in text
    # One unit per family: compute in whole GPUs, memory in bytes.
    assert 'flexgpu_shared_compute_gpus{node="s",product="NVIDIA L4",state="free"} 0.5' in text
    granted = {"node": "s", "product": "NVIDIA L4", "state": "granted"}
    assert registry.get_sample_value("flexgpu_shared_memory_bytes", granted) == 16 * 2**30
    assert "flexgpu_shared_capacity" not in text
    assert "flexgpu_claims_pending_oldest_seconds 300.0" in text
    assert "flexgpu_claims_unsatisfiable 1.0" in text
    collector.update(None)  # a follower exports no pool figures
    assert "flexgpu_devices_free{" not in generate_latest(registry).decode()


def test_exposition_passes_promtool_check_metrics() -> None:
    """Names, types and units as Prometheus wants them (no gauge named *_total, one unit
    per family), every family present."""
    metrics.POOL.update(_figures())
    metrics.WEBHOOK_DECISIONS.labels("ResourceClaim", "true").inc()
    metrics.WEBHOOK_ERRORS.labels("ResourceClaim").inc()
    metrics.DIAGNOSTIC_EVENTS.labels("Pod").inc()
    metrics.EXPLAIN_SECONDS.observe(0.01)
    metrics.CLAIM_WAIT_SECONDS.observe(3)
    try:
        text = generate_latest(REGISTRY)
        assert b"flexgpu_devices_published{" in text and b"flexgpu_shared_memory_bytes{" in text
        check_metrics(text)
    finally:
        metrics.POOL.update(None)
