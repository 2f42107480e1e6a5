"""Diagnostics passes: who gets an Event, when it is repeated, and when tracking ends."""

from __future__ import annotations

from typing import Any

from controller_builders import NOW, A, claim, holding, load, node, node_slices, pod, request

from flexgpu.controller.cluster_state import ClusterState
from flexgpu.controller.diagnostics import REASON, Diagnostics
from flexgpu.controller.events import EventTarget, event_name

L4 = f'{A}.productName == "NVIDIA L4"'


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, bool]] = []

    def emit(self, target: EventTarget, reason: str, message: str, *, repeat: bool) -> None:
        self.events.append((target.kind, target.name, message, repeat))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _objects(*extra_claims: dict[str, Any], pods: list[dict[str, Any]] | None = None) -> Any:
    return {
        "slices": node_slices("l4", "l4-2-pcie"),
        "nodes": [node("l4")],
        "claims": [claim("want", request("gpu.flexgpu.dev", 1, L4)), *extra_claims],
        "pods": pods if pods is not None else [pod("p", "want")],
    }


def _diagnostics() -> tuple[Diagnostics, Sink, Clock]:
    sink, clock = Sink(), Clock()
    return Diagnostics(sink, delay_s=30, recheck_s=5, reemit_s=600, clock=clock), sink, clock


STATE = ClusterState()


def snapshot(**objects: Any) -> Any:
    """The one cache of these tests, so revisions grow as they would in the controller."""
    return load(STATE, **objects)


def test_event_on_pod_and_claim_once_per_diagnosis() -> None:
    diag, sink, clock = _diagnostics()
    taken = _objects(holding("hog", "l4", "gpu-0", "gpu-1"))
    result = diag.run_pass(snapshot(**taken), NOW)
    assert (result.pending, result.unsatisfiable, result.emitted) == (1, 1, 2)
    assert [(k, n, r) for k, n, _, r in sink.events] == [
        ("Pod", "p", False),
        ("ResourceClaim", "want", False),
    ]
    assert "allocated to other claims (ns/hog)" in sink.events[0][2]
    # The same cluster again, and a changed one with the same diagnosis: nothing new.
    clock.now += 10
    diag.run_pass(snapshot(**taken), NOW)
    renamed = _objects(holding("other", "l4", "gpu-0", "gpu-1"))
    clock.now += 10
    diag.run_pass(snapshot(**renamed), NOW)
    assert len(sink.events) == 2


def test_changed_diagnosis_is_emitted_again_and_long_silence_repeats() -> None:
    diag, sink, clock = _diagnostics()
    diag.run_pass(snapshot(**_objects(holding("hog", "l4", "gpu-0", "gpu-1"))), NOW)
    tainted = _objects(holding("hog", "l4", "gpu-0"))
    tainted["slices"] = node_slices(
        "l4", "l4-2-pcie", taint={"key": "k", "value": "v", "effect": "NoSchedule"}
    )
    clock.now += 10
    diag.run_pass(snapshot(**tainted), NOW)
    assert len(sink.events) == 4 and "tainted k=v:NoSchedule" in sink.events[2][2]
    clock.now += 601
    diag.run_pass(snapshot(**tainted), NOW)
    assert len(sink.events) == 6 and sink.events[4][3] is True  # a repeat of the same text
    assert sink.events[4][2] == sink.events[2][2]


def test_rechecks_wait_for_a_change_and_the_recheck_interval() -> None:
    diag, _, clock = _diagnostics()
    snap = snapshot(**_objects(holding("hog", "l4", "gpu-0", "gpu-1")))
    assert diag.run_pass(snap, NOW).explained == 1
    clock.now += 60
    assert diag.run_pass(snap, NOW).explained == 0  # same revision: nothing to re-explain
    changed = snapshot(**_objects(holding("hog", "l4", "gpu-0")))
    clock.now += 1
    assert diag.run_pass(changed, NOW).explained == 1
    again = snapshot(**_objects(holding("hog", "l4", "gpu-1")))
    clock.now += 1
    assert diag.run_pass(again, NOW).explained == 0  # within recheck_s


def test_satisfiable_and_young_claims_get_nothing_and_tracking_ends() -> None:
    diag, sink, clock = _diagnostics()
    fits = diag.run_pass(snapshot(**_objects()), NOW)
    assert (fits.pending, fits.unsatisfiable, sink.events) == (1, 0, [])
    young = _objects(holding("hog", "l4", "gpu-0", "gpu-1"), pods=[pod("p", "want", age_s=3)])
    assert diag.run_pass(snapshot(**young), NOW).pending == 0
    assert diag.tracked == {} and sink.events == []
    diag.run_pass(snapshot(**_objects(holding("hog", "l4", "gpu-0", "gpu-1"))), NOW)
    assert diag.tracked
    clock.now += 10
    scheduled = _objects(pods=[pod("p", "want", node_name="l4")])
    diag.run_pass(snapshot(**scheduled), NOW)
    assert diag.tracked == {}


def test_failed_writes_are_retried_next_pass() -> None:
    class Failing(Sink):
        fail = True

        def emit(self, target: EventTarget, reason: str, message: str, *, repeat: bool) -> None:
            if self.fail:
                raise RuntimeError("apiserver away")
            super().emit(target, reason, message, repeat=repeat)

    sink, clock = Failing(), Clock()
    diag = Diagnostics(sink, delay_s=30, clock=clock)
    snap = snapshot(**_objects(holding("hog", "l4", "gpu-0", "gpu-1")))
    assert diag.run_pass(snap, NOW).emitted == 0
    sink.fail = False
    clock.now += 1
    assert diag.run_pass(snap, NOW).emitted == 2


def test_event_names_are_stable_per_object_and_text() -> None:
    target = EventTarget("Pod", "v1", "ns", "p" * 300, "uid-1")
    name = event_name(target, REASON, "text")
    assert name == event_name(target, REASON, "text") and len(name) <= 253
    assert name != event_name(target, REASON, "other text")
