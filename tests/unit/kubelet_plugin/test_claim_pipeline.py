"""The claim pipeline and each of its stages alone: stages run in the order given, outermost
first, for prepare and unprepare alike; the start-up gate answers every claim itself and
nothing behind it runs; per-claim errors and exceptions travel back through every stage
unchanged; a call held in the gate goes on along the path completed meanwhile; concurrent
calls are not serialised by the pipeline; the plugin's own order is gate, metrics, tenancy."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent import futures

import pytest

from flexgpu.kubelet_plugin.claims.pipeline import (
    NOT_COMPLETE,
    PREPARE,
    UNPREPARE,
    Call,
    ClaimPipeline,
    R,
    Step,
)
from flexgpu.kubelet_plugin.claims.startup_gate import StartupGate
from flexgpu.kubelet_plugin.claims.tenant_attribute import TenantTracking
from flexgpu.kubelet_plugin.kubeletplugin import (
    ClaimRef,
    PreparedDevice,
    PrepareResult,
    UnprepareResult,
)
from tests.unit.kubeletplugin.fakes import MemoryHealth

TIMEOUT = 10
A = ClaimRef("ns", "a", "u1")
B = ClaimRef("ns", "b", "u2")


class Recording:
    """A stage that notes when the call enters and leaves it, and what came back."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self._log = log
        self.seen: list[Mapping[str, object]] = []

    def around(
        self, call: Call[R], claims: Sequence[ClaimRef], next_step: Step[R]
    ) -> Mapping[str, R]:
        self._log.append(f"{self.name} {call.name} in")
        results = next_step(claims)
        self.seen.append(dict(results))
        self._log.append(f"{self.name} out")
        return results


class End:
    """The preparer at the end: b fails, the rest succeed; or it raises."""

    def __init__(self, log: list[str], raises: Exception | None = None) -> None:
        self._log = log
        self._raises = raises

    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        self._log.append("end prepare")
        if self._raises is not None:
            raise self._raises
        return {
            c.uid: PrepareResult.failed(f"claim {c.namespace}/{c.name} not found")
            if c.name == "b"
            else PrepareResult(devices=(PreparedDevice("node-a", f"gpu-{c.name}"),))
            for c in claims
        }

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, UnprepareResult]:
        self._log.append("end unprepare")
        if self._raises is not None:
            raise self._raises
        return {c.uid: UnprepareResult("busy" if c.name == "b" else "") for c in claims}


def _opened(wait_s: float = TIMEOUT) -> StartupGate:
    gate = StartupGate(wait_s=wait_s)
    gate.open(MemoryHealth())
    return gate


def test_stages_run_in_the_order_given_for_prepare_and_unprepare() -> None:
    log: list[str] = []
    first, second = Recording("first", log), Recording("second", log)
    pipeline = ClaimPipeline([_opened(), first, second], End(log))
    pipeline.prepare([A])
    pipeline.unprepare([A])
    assert log == [
        "first prepare in",
        "second prepare in",
        "end prepare",
        "second out",
        "first out",
        "first unprepare in",
        "second unprepare in",
        "end unprepare",
        "second out",
        "first out",
    ]
    assert pipeline.names == ("start-up gate", "first", "second", "End")


@pytest.mark.parametrize("call", [PREPARE, UNPREPARE], ids=lambda c: c.name)
def test_a_failed_start_up_answers_every_claim_at_the_gate_and_nothing_behind_it_runs(
    call: Call[R],
) -> None:
    log: list[str] = []
    gate = StartupGate(wait_s=TIMEOUT)
    pipeline = ClaimPipeline([gate])
    pipeline.complete([gate, Recording("behind", log)], End(log))
    gate.fail("no GPUs: NVML not found")
    results = call.invoke(pipeline, [A, B])
    assert log == []
    assert set(results) == {"u1", "u2"}
    for result in results.values():
        assert result.error == "the plugin failed to start: no GPUs: NVML not found"
        assert type(result) is (PrepareResult if call is PREPARE else UnprepareResult)


def test_the_gate_alone_answers_still_starting_when_start_up_takes_too_long() -> None:
    gate = StartupGate(wait_s=0.05)

    def never(claims: Sequence[ClaimRef]) -> Mapping[str, UnprepareResult]:
        raise AssertionError("the gate went on before start-up finished")

    results = gate.around(UNPREPARE, [A], never)
    assert "still starting" in results["u1"].error


def test_per_claim_errors_pass_every_stage_unchanged() -> None:
    log: list[str] = []
    outer = Recording("outer", log)
    pipeline = ClaimPipeline([_opened(), outer], End(log))
    prepared = pipeline.prepare([A, B])
    assert prepared["u1"].error == "" and prepared["u1"].devices[0].device_name == "gpu-a"
    assert prepared["u2"].error == "claim ns/b not found"
    unprepared = pipeline.unprepare([A, B])
    assert unprepared == {"u1": UnprepareResult(""), "u2": UnprepareResult("busy")}
    assert outer.seen == [dict(prepared), dict(unprepared)]


def test_an_exception_from_the_end_travels_back_through_every_stage() -> None:
    log: list[str] = []
    updates: list[str] = []
    pipeline = ClaimPipeline(
        [_opened(), TenantTracking(lambda: updates.append("update"))],
        End(log, raises=OSError(28, "No space left on device")),
    )
    with pytest.raises(OSError, match="No space left"):
        pipeline.prepare([A])
    assert updates == ["update"], "the tenancy stage updates after a failed call too"


def test_a_call_held_in_the_gate_goes_on_along_the_path_completed_meanwhile() -> None:
    log: list[str] = []
    gate = StartupGate(wait_s=TIMEOUT)
    pipeline = ClaimPipeline([gate])
    with futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(pipeline.prepare, [A])
        with pytest.raises(futures.TimeoutError):
            held.result(timeout=0.2)
        pipeline.complete([gate, Recording("later", log)], End(log))
        gate.open(MemoryHealth())
        result = held.result(timeout=TIMEOUT)
    assert result["u1"].error == ""
    assert log == ["later prepare in", "end prepare", "later out"]


def test_a_path_without_an_end_answers_each_claim_that_the_plugin_is_starting() -> None:
    results = ClaimPipeline([_opened()]).prepare([A, B])
    assert {uid: r.error for uid, r in results.items()} == {"u1": NOT_COMPLETE, "u2": NOT_COMPLETE}


def test_completing_is_refused_for_a_path_that_drops_the_served_stages_or_twice() -> None:
    gate = StartupGate()
    pipeline = ClaimPipeline([gate])
    with pytest.raises(ValueError, match=r"stages: \[other\] does not begin .*allowed: .*start-up"):
        pipeline.complete([Recording("other", [])], End([]))
    pipeline.complete([gate], End([]))
    with pytest.raises(RuntimeError, match="complete already"):
        pipeline.complete([gate], End([]))


def test_concurrent_calls_pass_the_pipeline_at_the_same_time() -> None:
    """Calls of different pods are inside the preparer together: no stage serialises them."""
    calls = 6
    inside = threading.Barrier(calls, timeout=TIMEOUT)

    class Together(End):
        def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
            inside.wait()  # breaks (and fails the test) unless all calls get here at once
            return super().prepare(claims)

    log: list[str] = []
    pipeline = ClaimPipeline(
        [_opened(), Recording("stage", log), TenantTracking(lambda: None)], Together(log)
    )
    refs = [ClaimRef("ns", f"c{i}", f"u{i}") for i in range(calls)]
    with futures.ThreadPoolExecutor(calls) as pool:
        results = list(pool.map(lambda ref: pipeline.prepare([ref]), refs))
    assert [r[ref.uid].devices[0].device_name for r, ref in zip(results, refs, strict=True)] == [
        f"gpu-c{i}" for i in range(calls)
    ]


def test_tenancy_updates_after_each_call_with_claims_and_survives_a_failing_update(
    caplog: pytest.LogCaptureFixture,
) -> None:
    updates: list[str] = []
    stage = TenantTracking(lambda: updates.append("update"))
    pipeline = ClaimPipeline([stage], End([]))
    pipeline.prepare([A])
    pipeline.unprepare([A])
    pipeline.prepare([])  # the kubelet's liveness probe: nothing to update
    assert updates == ["update", "update"]

    def broken() -> None:
        raise RuntimeError("publisher gone")

    with caplog.at_level(logging.ERROR):
        result = ClaimPipeline([TenantTracking(broken)], End([])).prepare([A])
    assert result["u1"].error == ""
    assert "could not update the shared GPUs' tenant attribute" in caplog.text


@pytest.mark.parametrize("observed", [False, True])
def test_the_plugin_passes_gate_then_metrics_then_tenancy(observed: bool) -> None:
    from flexgpu.kubelet_plugin.main import claim_stages

    gate = StartupGate()
    names = [s.name for s in claim_stages(gate, lambda: None, "node-a", observed)]
    assert names == (
        ["start-up gate", "metrics", "tenancy"] if observed else ["start-up gate", "tenancy"]
    )


def test_metrics_times_each_call_and_counts_its_failed_claims_passing_them_on_unchanged() -> None:
    from flexgpu.kubelet_plugin.observe import metrics

    node = "pipeline-node"

    def sample(name: str, **labels: str) -> float:
        return metrics.REGISTRY.get_sample_value(name, {"node": node, **labels}) or 0.0

    pipeline = ClaimPipeline([metrics.CallMetrics(node)], End([]))
    busy = sample("flexgpu_plugin_unprepare_errors_total", reason="other")
    timed = sample("flexgpu_plugin_unprepare_duration_seconds_count")
    results = pipeline.unprepare([A, B])
    assert results == {"u1": UnprepareResult(""), "u2": UnprepareResult("busy")}
    assert sample("flexgpu_plugin_unprepare_errors_total", reason="other") == busy + 1
    assert sample("flexgpu_plugin_unprepare_duration_seconds_count") == timed + 1
    assert sample("flexgpu_plugin_prepare_duration_seconds_count") == 0, "unprepare only"
