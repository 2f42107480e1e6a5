"""The plugin's operation metrics: prepare/unprepare timed and failures counted by reason,
MIG and MPS operations and health events counted where the plugin reaches the hardware,
GPUs by health and slice publishing read at scrape time, settings refused with their name;
and the whole exposition passes promtool."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from flexgpu.driver.backend_errors import InUseError, NotFoundError
from flexgpu.driver.durations import parse_duration
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.sim_usage import USAGE_FILE_NAME
from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimRecord, ClaimState, DeviceRecord
from flexgpu.kubelet_plugin.claims.pipeline import ClaimPipeline
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef, PrepareResult, UnprepareResult
from flexgpu.kubelet_plugin.observe import metrics
from flexgpu.kubelet_plugin.observe.metrics_setup import (
    CLAIM_REREAD_S,
    ClaimReader,
    MetricsSettingError,
    settings_from_env,
)
from flexgpu.kubelet_plugin.observe.observed_backend import ObservedBackend
from flexgpu.kubelet_plugin.observe.usage import UsageSampler
from flexgpu.kubelet_plugin.observe.usage_metrics import UsageCollector
from flexgpu.kubelet_plugin.observe.usage_model import UsageSettings
from tests.promtool import check_metrics

NODE = "metrics-node"


def value(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, {"node": NODE, **labels}) or 0.0


class FakePreparer:
    def __init__(self, errors: Mapping[str, str]) -> None:
        self.errors = errors

    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        return {c.uid: PrepareResult(error=self.errors.get(c.uid, "")) for c in claims}

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, UnprepareResult]:
        raise OSError(28, "No space left on device")


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        ("claim team/a not found", "claim_not_found"),
        ("claim team/a is not allocated", "not_allocated"),
        ("claim team/a changed meanwhile; retry", "conflict"),
        (
            "claim team/a: gpu-2 serves the claims of another namespace; a shared GPU serves "
            "one namespace at a time",
            "conflict",
        ),
        ("MIG instance for gpu-0-mig-1g10gb-0 has no UUID", "mig"),
        ("the plugin is still starting (GPU discovery ...); retry", "starting"),
        ("preparing claim team/a: [Errno 28] No space left on device", "node_state"),
        ("something unheard of", "other"),
    ],
)
def test_errors_are_counted_by_reason(error: str, reason: str) -> None:
    assert metrics.error_reason(error) == reason


def test_prepare_and_unprepare_are_timed_and_failures_counted() -> None:
    observed = ClaimPipeline(
        [metrics.CallMetrics(NODE)], FakePreparer({"u2": "claim ns/b not found"})
    )
    before = value("flexgpu_plugin_prepare_errors_total", reason="claim_not_found")
    count = value("flexgpu_plugin_prepare_duration_seconds_count")
    observed.prepare([ClaimRef("ns", "a", "u1"), ClaimRef("ns", "b", "u2")])
    assert value("flexgpu_plugin_prepare_errors_total", reason="claim_not_found") == before + 1
    assert value("flexgpu_plugin_prepare_duration_seconds_count") == count + 1
    unprepare_before = value("flexgpu_plugin_unprepare_errors_total", reason="node_state")
    with pytest.raises(OSError):
        observed.unprepare([ClaimRef("ns", "a", "u1")])
    assert value("flexgpu_plugin_unprepare_errors_total", reason="node_state") == (
        unprepare_before + 1
    )


def test_mig_mps_and_health_events_are_counted_at_the_backend() -> None:
    sim = SimulatedBackend.from_topology("dgx-a100-8", NODE)
    backend = ObservedBackend(sim, NODE)
    backend.set_mig_mode(0, True)
    profile = next(p for p in backend.mig_profiles(0) if p.name == "1g.10gb")
    created = value(
        "flexgpu_plugin_mig_operations_total", operation="create", profile="1g.10gb", result="ok"
    )
    device = backend.create_mig_device(0, profile.profile_id, profile.placements[0])
    backend.destroy_mig_device(0, device.gpu_instance_id)
    assert (
        value(
            "flexgpu_plugin_mig_operations_total",
            operation="create",
            profile="1g.10gb",
            result="ok",
        )
        == created + 1
    )
    assert (
        value(
            "flexgpu_plugin_mig_operations_total",
            operation="destroy",
            profile="1g.10gb",
            result="ok",
        )
        >= 1
    )
    failed = value(
        "flexgpu_plugin_mig_operations_total", operation="destroy", profile="", result="error"
    )
    with pytest.raises(NotFoundError):
        backend.destroy_mig_device(0, device.gpu_instance_id)  # gone already
    assert (
        value(
            "flexgpu_plugin_mig_operations_total", operation="destroy", profile="", result="error"
        )
        == failed + 1
    )
    started = value("flexgpu_plugin_mps_daemon_operations_total", operation="start", result="ok")
    backend.start_mps_daemon(1)
    backend.stop_mps_daemon(1)
    assert (
        value("flexgpu_plugin_mps_daemon_operations_total", operation="start", result="ok")
        == started + 1
    )
    xids = value("flexgpu_plugin_health_events_total", kind="Xid", xid="79")
    sim.inject_xid(2, 79)
    assert backend.wait_health_event(1.0) is not None
    assert value("flexgpu_plugin_health_events_total", kind="Xid", xid="79") == xids + 1


def test_failed_mps_start_is_counted_as_error() -> None:
    sim = SimulatedBackend.from_topology("l4-2-pcie", NODE)
    sim.faults.fail_next("start_mps_daemon", error=InUseError)
    backend = ObservedBackend(sim, NODE)
    before = value("flexgpu_plugin_mps_daemon_operations_total", operation="start", result="error")
    with pytest.raises(InUseError):
        backend.start_mps_daemon(0)
    assert (
        value("flexgpu_plugin_mps_daemon_operations_total", operation="start", result="error")
        == before + 1
    )


def test_settings_are_refused_with_the_variable_and_what_is_allowed() -> None:
    assert settings_from_env({}).port is None
    settings = settings_from_env(
        {
            "FLEXGPU_METRICS_PORT": "8081",
            "FLEXGPU_IDLE_WINDOW": "1h30m",
            "FLEXGPU_IDLE_THRESHOLD": "0.1",
            "FLEXGPU_USAGE_INTERVAL": "5",
        }
    )
    assert (settings.port, settings.usage.idle_window_s) == (8081, 5400)
    assert (settings.usage.idle_threshold, settings.usage.interval_s) == (0.1, 5)
    with pytest.raises(MetricsSettingError, match=r"FLEXGPU_IDLE_WINDOW: '2 hours'.*90s"):
        settings_from_env({"FLEXGPU_IDLE_WINDOW": "2 hours"})
    with pytest.raises(MetricsSettingError, match=r"FLEXGPU_IDLE_THRESHOLD: '5'.*0 to 1"):
        settings_from_env({"FLEXGPU_IDLE_THRESHOLD": "5"})
    with pytest.raises(MetricsSettingError, match=r"FLEXGPU_METRICS_PORT: '70000'"):
        settings_from_env({"FLEXGPU_METRICS_PORT": "70000"})
    assert parse_duration("90s") == 90 and parse_duration("2h") == 7200


def plugin_exposition(tmp_path: Path) -> bytes:
    """The plugin registry's text with every family filled: node, usage and operations."""
    sim = SimulatedBackend.from_topology("l4-2-pcie", NODE, state_path=tmp_path / "state.json")
    load = {"gpus": {"0": {"processes": [{"pid": 9, "usedMemoryMiB": 64, "smUtilization": 50}]}}}
    (tmp_path / USAGE_FILE_NAME).write_text(json.dumps(load))
    backend = ObservedBackend(sim, NODE)
    devices = NodeDevices(backend)
    records = [
        ClaimRecord(
            uid="u",
            namespace="team",
            name="c",
            state=ClaimState.PREPARED,
            devices=[DeviceRecord(pool_name=NODE, device_name="gpu-0")],
        )
    ]
    sampler = UsageSampler(
        NODE,
        backend,
        devices=devices,
        records=lambda: records,
        claim_object=lambda r: None,
        settings=UsageSettings(),
    )
    sampler.sample_once()
    sampler.sample_once()
    metrics.register("usage", UsageCollector(sampler))
    metrics.register(
        "node",
        metrics.NodeCollector(
            metrics.NodeSources(
                NODE,
                gpu_health=lambda: [g.health for g in devices.gpus()],
                slice_counts=lambda: (3, 1),
                status_refusals=lambda: 2,
            )
        ),
    )
    observed = ClaimPipeline(
        [metrics.CallMetrics(NODE)], FakePreparer({"x": "claim a/b not found"})
    )
    observed.prepare([ClaimRef("a", "b", "x")])
    with pytest.raises(OSError):
        observed.unprepare([ClaimRef("a", "b", "x")])
    sim.inject_xid(1, 48)
    backend.wait_health_event(1.0)
    sim.lose_gpu(1)
    backend.wait_health_event(1.0)
    metrics.mig_operation(NODE, "create", "1g.10gb", "ok")
    backend.start_mps_daemon(0)
    return generate_latest(metrics.REGISTRY)


def test_plugin_exposition_passes_promtool_and_is_served(tmp_path: Path) -> None:
    text = plugin_exposition(tmp_path)
    for family in (
        b"flexgpu_plugin_prepare_duration_seconds_bucket{",
        b"flexgpu_plugin_prepare_errors_total{",
        b"flexgpu_plugin_unprepare_errors_total{",
        b"flexgpu_plugin_health_events_total{",
        b"flexgpu_plugin_mig_operations_total{",
        b"flexgpu_plugin_mps_daemon_operations_total{",
        b"flexgpu_plugin_slice_publishes_total{",
        b'flexgpu_plugin_claim_status_refused_total{node="metrics-node"} 2.0',
        b"flexgpu_plugin_gpus{",
        b"flexgpu_claim_sm_utilization_ratio{",
        b"flexgpu_claim_used_gpu_seconds_total{",
        b"flexgpu_gpu_memory_used_bytes{",
        b"process_resident_memory_bytes",
    ):
        assert family in text, family
    check_metrics(text)
    server = metrics.MetricsServer(0, "127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            assert b"flexgpu_claim_allocated_gpus{" in r.read()
    finally:
        server.stop()


def test_claim_objects_come_from_the_cache_then_are_reread_now_and_then() -> None:
    """The plugin's own copy first; a GET only every CLAIM_REREAD_S (pods join shared claims
    later), and a GET that returns a re-created claim (another UID) is not taken."""
    now = [0.0]
    reads: list[str] = []
    cached = {"u1": {"metadata": {"uid": "u1"}, "status": {"reservedFor": []}}}
    fresh = {"metadata": {"uid": "u1"}, "status": {"reservedFor": [{"resource": "pods"}]}}

    def read(namespace: str, name: str) -> dict[str, Any]:
        reads.append(name)
        return fresh if name == "a" else {"metadata": {"uid": "other"}}

    reader = ClaimReader(cached.get, read, clock=lambda: now[0])
    record = ClaimRecord(uid="u1", namespace="ns", name="a", state=ClaimState.PREPARED)
    assert reader(record) is cached["u1"] and reads == []
    now[0] += CLAIM_REREAD_S / 2
    assert reader(record) is cached["u1"] and reads == []
    now[0] += CLAIM_REREAD_S
    assert reader(record) is fresh and reads == ["a"]
    recreated = ClaimRecord(uid="u2", namespace="ns", name="b", state=ClaimState.PREPARED)
    assert reader(recreated) is None and reads == ["a", "b"]
