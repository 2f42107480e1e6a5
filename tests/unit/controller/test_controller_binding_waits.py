"""Pods held for flexgpu's binding conditions: parsing, who gets an Event and when, when
tracking ends, the metric, and what ``flexgpu explain`` says."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from controller_builders import NOW, claim, device_classes, load, pod, request, stamp
from prometheus_client import CollectorRegistry, generate_latest

from flexgpu.controller import active, cli_explain, metrics
from flexgpu.controller.binding_waits import REASON, BindingWaits
from flexgpu.controller.cli_cluster import ClusterRead
from flexgpu.controller.cluster_state import ClusterState
from flexgpu.controller.diagnostics import Diagnostics
from flexgpu.controller.events import EventTarget
from flexgpu.controller.main import build_parser, config_from_args
from flexgpu.controller.records import DeviceBinding, claim_record, device_bindings
from flexgpu.driver.names import (
    DRIVER_NAME,
    PARTITION_FAILED_CONDITION,
    PARTITION_READY_CONDITION,
    TENANT_READY_CONDITION,
    TENANT_TAKEN_CONDITION,
)

MIG = "gpu-0-mig-1g.10gb-0"
MIG2 = "gpu-1-mig-1g.10gb-0"


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, str, bool]] = []

    def emit(self, target: EventTarget, reason: str, message: str, *, repeat: bool) -> None:
        self.events.append((target.kind, target.name, reason, message, repeat))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def result(device: str = MIG, *, pool: str = "h100", share: str = "", tenant: bool = False) -> Any:
    body: dict[str, Any] = {"request": "gpu", "driver": DRIVER_NAME, "pool": pool, "device": device}
    if tenant:
        body["bindingConditions"] = [TENANT_READY_CONDITION]
        body["bindingFailureConditions"] = [TENANT_TAKEN_CONDITION]
    else:
        body["bindingConditions"] = [PARTITION_READY_CONDITION]
        body["bindingFailureConditions"] = [PARTITION_FAILED_CONDITION]
    if share:
        body["shareID"] = share
    return body


def entry(device: str = MIG, *true: str, pool: str = "h100", share: str = "") -> Any:
    body: dict[str, Any] = {
        "driver": DRIVER_NAME,
        "pool": pool,
        "device": device,
        "conditions": [
            {"type": t, "status": "True", "reason": "R", "message": "", "lastTransitionTime": ""}
            for t in true
        ],
    }
    if share:
        body["shareID"] = share
    return body


def waiting(
    name: str = "c",
    *results: Any,
    allocated_s_ago: float | None = 120,
    devices: list[Any] | None = None,
) -> dict[str, Any]:
    """A claim allocated ``results`` (default: one on-demand MIG partition on node h100)."""
    body = claim(name, request("mig.flexgpu.dev"), results=list(results) or [result()])
    allocation = body["status"]["allocation"]
    allocation["nodeSelector"] = {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["h100"]}]}
        ]
    }
    if allocated_s_ago is not None:
        allocation["allocationTimestamp"] = stamp(allocated_s_ago)
    body["status"]["reservedFor"] = [{"resource": "pods", "name": "p", "uid": "uid-p"}]
    if devices is not None:
        body["status"]["devices"] = devices
    return body


STATE = ClusterState()


def snapshot(claims: list[Any], pods: list[Any] | None = None) -> Any:
    """The one cache of these tests, so revisions grow as they would in the controller."""
    STATE.replace("classes", device_classes())
    STATE.replace("claims", claims)
    STATE.replace("pods", [pod("p", "c", age_s=200)] if pods is None else pods)
    return STATE.snapshot()


def _waits(grace_s: float = 60) -> tuple[BindingWaits, Sink, Clock]:
    sink, clock = Sink(), Clock()
    return BindingWaits(sink, grace_s=grace_s, reemit_s=600, clock=clock), sink, clock


# --- parsing ----------------------------------------------------------------------------------


def test_record_keeps_allocation_time_and_what_each_device_waits_for() -> None:
    theirs = {**result("x"), "driver": "other.dev", "bindingConditions": ["other.dev/Ready"]}
    record = claim_record(
        waiting(
            "c",
            result(MIG),
            result(MIG2),
            result("gpu-2", tenant=True, share="s-1"),
            theirs,
            {"request": "gpu", "driver": DRIVER_NAME, "pool": "h100", "device": "gpu-3"},
            devices=[
                entry(MIG, PARTITION_READY_CONDITION),
                entry("gpu-2", TENANT_READY_CONDITION, share="other-share"),  # not this share
                {**entry(MIG2, PARTITION_READY_CONDITION), "driver": "other.dev"},  # not ours
            ],
        )
    )
    assert record.allocated_at == NOW - timedelta(seconds=120)
    assert record.bindings == (
        DeviceBinding("h100", MIG, "", ()),
        DeviceBinding("h100", MIG2, "", (PARTITION_READY_CONDITION,)),
        DeviceBinding("h100", "gpu-2", "s-1", (TENANT_READY_CONDITION,)),
    )
    assert [b.device for b in record.binding_pending] == [MIG2, "gpu-2"]
    assert not record.binding_failed


def test_a_true_failure_condition_ends_the_wait() -> None:
    record = claim_record(
        waiting("c", result(MIG), result(MIG2), devices=[entry(MIG2, PARTITION_FAILED_CONDITION)])
    )
    assert record.binding_failed and record.binding_pending == ()
    assert record.bindings[1].failed == (PARTITION_FAILED_CONDITION,)


@pytest.mark.parametrize(
    "status",
    [
        None,
        "text",
        {"allocation": "text"},
        {"allocation": {"devices": {"results": "text"}}},
        {"allocation": {"devices": {"results": [None, 3, {"driver": DRIVER_NAME}]}}},
        {"allocation": {"devices": {"results": [result()]}}, "devices": "text"},
        {"allocation": {"devices": {"results": [result()]}}, "devices": [None, {"conditions": 3}]},
        {
            "allocation": {"devices": {"results": [{**result(), "bindingFailureConditions": 7}]}},
            "devices": [{**entry(), "conditions": [None, "x", {"status": "True"}]}],
        },
    ],
)
def test_malformed_status_never_raises(status: Any) -> None:
    found = device_bindings(status)
    assert all(isinstance(b, DeviceBinding) for b in found)


def test_a_claim_with_malformed_status_devices_is_still_recorded() -> None:
    body = waiting("c", devices=[{"driver": DRIVER_NAME, "conditions": "x"}, "junk"])
    body["status"]["allocation"]["allocationTimestamp"] = "yesterday"
    record = claim_record(body)
    assert record.allocated and record.allocated_at is None
    assert record.binding_pending[0].pending == (PARTITION_READY_CONDITION,)


# --- Events -----------------------------------------------------------------------------------


def test_no_event_inside_the_grace_period() -> None:
    waits, sink, _ = _waits()
    result_ = waits.run_pass(snapshot([waiting(allocated_s_ago=59)]), NOW)
    assert (result_.waiting, result_.emitted, sink.events) == (0, 0, [])
    assert waits.tracked == {}


def test_event_on_pod_and_claim_names_condition_device_node_and_how_long() -> None:
    waits, sink, _ = _waits()
    outcome = waits.run_pass(snapshot([waiting(allocated_s_ago=150)]), NOW)
    assert (outcome.waiting, outcome.emitted) == (1, 2)
    assert [(k, n, r, rep) for k, n, r, _, rep in sink.events] == [
        ("ResourceClaim", "c", REASON, False),
        ("Pod", "p", REASON, False),
    ]
    for _, _, _, text, _ in sink.events:
        assert PARTITION_READY_CONDITION in text
        assert f"device {MIG} on node h100" in text
        assert "allocated at 2026-01-01T11:57:30Z, 2m ago" in text
        assert "kubelet plugin pod on that node is running" in text
        assert "its log for claim ns/c" in text
        assert "MIG partition" in text
    assert sink.events[1][3].startswith("Pod ns/p is not bound to a node yet")


def test_tenant_ready_points_at_the_tenant_decision() -> None:
    waits, sink, _ = _waits()
    waits.run_pass(snapshot([waiting("c", result("gpu-1", tenant=True, share="s-9"))]), NOW)
    text = sink.events[0][3]
    assert f"{TENANT_READY_CONDITION} of device gpu-1 (share s-9) on node h100" in text
    assert "tenant decision" in text and "MIG" not in text


def test_no_repeat_while_unchanged_then_a_repeat_after_the_reemit_period() -> None:
    waits, sink, clock = _waits()
    snap = snapshot([waiting()])
    waits.run_pass(snap, NOW)
    clock.now += 30
    assert waits.run_pass(snap, NOW + timedelta(seconds=30)).emitted == 0
    clock.now += 600
    later = NOW + timedelta(seconds=630)
    assert waits.run_pass(snapshot([waiting()]), later).emitted == 2
    assert len(sink.events) == 4
    # The same words, marked as a repeat: the Event's count goes up, no new Event.
    assert [e[3] for e in sink.events[2:]] == [e[3] for e in sink.events[:2]]
    assert [e[4] for e in sink.events[2:]] == [True, True]


def test_a_change_of_what_it_waits_for_is_told_again() -> None:
    waits, sink, clock = _waits()
    waits.run_pass(snapshot([waiting("c", result(MIG), result(MIG2))]), NOW)
    assert MIG in sink.events[0][3] and MIG2 in sink.events[0][3]
    assert "flexgpu's binding conditions " in sink.events[0][3]
    clock.now += 10
    half = waiting("c", result(MIG), result(MIG2), devices=[entry(MIG, PARTITION_READY_CONDITION)])
    assert waits.run_pass(snapshot([half]), NOW).emitted == 2
    assert MIG not in sink.events[2][3] and MIG2 in sink.events[2][3]
    assert (
        f"flexgpu's binding condition {PARTITION_READY_CONDITION} of device {MIG2}"
        in (sink.events[2][3])
    )
    assert sink.events[2][4] is False


@pytest.mark.parametrize(
    ("claims", "pods"),
    [
        # the condition is met
        ([waiting(devices=[entry(MIG, PARTITION_READY_CONDITION)])], None),
        # the plugin reported a failure: the scheduler sends the pod back
        ([waiting(devices=[entry(MIG, PARTITION_FAILED_CONDITION)])], None),
        # the claim was deallocated
        ([claim("c", request("mig.flexgpu.dev"))], None),
        # the claim is gone
        ([], None),
        # the pod was bound (the controller's cache keeps no bound pod; explain's may)
        ([waiting()], [pod("p", "c", age_s=200, node_name="h100")]),
        ([waiting()], []),
    ],
    ids=["met", "failed", "deallocated", "claim-gone", "bound", "pod-gone"],
)
def test_tracking_ends(claims: list[Any], pods: list[Any] | None) -> None:
    waits, sink, clock = _waits()
    waits.run_pass(snapshot([waiting()]), NOW)
    assert waits.tracked and waits.tracked_claims and len(sink.events) == 2
    clock.now += 10
    outcome = waits.run_pass(snapshot(claims, pods), NOW)
    assert (outcome.waiting, outcome.emitted) == (0, 0)
    assert waits.tracked == {} and waits.tracked_claims == {}
    assert len(sink.events) == 2


def test_without_allocation_timestamp_the_grace_counts_from_first_seen() -> None:
    waits, sink, _ = _waits()
    snap = snapshot([waiting(allocated_s_ago=None)])
    assert waits.run_pass(snap, NOW).emitted == 0
    assert waits.run_pass(snap, NOW + timedelta(seconds=59)).emitted == 0
    assert waits.run_pass(snap, NOW + timedelta(seconds=61)).emitted == 2
    assert "seen allocated at 2026-01-01T12:00:00Z, 1m ago" in sink.events[0][3]


def test_a_shared_claim_is_told_once_and_each_pod_once() -> None:
    waits, sink, _ = _waits()
    pods = [pod("p", "c", age_s=200), pod("q", "c", age_s=200), pod("r", "other")]
    waits.run_pass(snapshot([waiting()], pods), NOW)
    assert sorted((k, n) for k, n, *_ in sink.events) == [
        ("Pod", "p"),
        ("Pod", "q"),
        ("ResourceClaim", "c"),
    ]


def test_other_drivers_conditions_are_not_ours() -> None:
    theirs = {**result(), "driver": "other.dev", "bindingConditions": ["other.dev/Ready"]}
    waits, sink, _ = _waits()
    assert waits.run_pass(snapshot([waiting("c", theirs)]), NOW).waiting == 0
    assert sink.events == []


def test_failed_writes_are_retried_next_pass_and_lost_leadership_forgets() -> None:
    class Failing(Sink):
        fail = True

        def emit(self, target: EventTarget, reason: str, message: str, *, repeat: bool) -> None:
            if self.fail:
                raise RuntimeError("apiserver away")
            super().emit(target, reason, message, repeat=repeat)

    sink, clock = Failing(), Clock()
    waits = BindingWaits(sink, grace_s=60, clock=clock)
    snap = snapshot([waiting()])
    assert waits.run_pass(snap, NOW).emitted == 0
    sink.fail = False
    clock.now += 1
    assert waits.run_pass(snap, NOW).emitted == 2
    waits.forget()
    assert waits.tracked == {} and waits.run_pass(snap, NOW).emitted == 2


# --- metrics ----------------------------------------------------------------------------------


def test_claims_waiting_past_the_grace_period_by_condition() -> None:
    waits, _, _ = _waits()
    claims = [
        waiting("c"),
        waiting("d", result(MIG2), result("gpu-2", tenant=True, share="s")),
        waiting("e", result("gpu-3", tenant=True, share="t"), allocated_s_ago=10),  # young
    ]
    pods = [pod("p", "c", age_s=200), pod("q", "d", age_s=200), pod("r", "e", age_s=200)]
    before = metrics.BINDING_WAIT_EVENTS.labels(kind="Pod")._value.get()
    outcome = waits.run_pass(snapshot(claims, pods), NOW)
    assert outcome.waiting == 2
    assert outcome.by_condition == {PARTITION_READY_CONDITION: 2, TENANT_READY_CONDITION: 1}
    assert metrics.BINDING_WAIT_EVENTS.labels(kind="Pod")._value.get() == before + 2

    collector = metrics.PoolCollector()
    registry = CollectorRegistry()
    registry.register(collector)
    collector.update(
        metrics.pool_figures(STATE.snapshot(), NOW, binding_pending=outcome.by_condition)
    )
    value = registry.get_sample_value
    assert value("flexgpu_claims_binding_pending", {"condition": PARTITION_READY_CONDITION}) == 2
    assert value("flexgpu_claims_binding_pending", {"condition": TENANT_READY_CONDITION}) == 1
    # Nothing waits: the known conditions read 0 rather than vanish.
    idle = waits.run_pass(snapshot([]), NOW)
    collector.update(metrics.pool_figures(STATE.snapshot(), NOW, binding_pending=idle.by_condition))
    assert value("flexgpu_claims_binding_pending", {"condition": TENANT_READY_CONDITION}) == 0
    collector.update(None)  # a follower exports none
    assert "flexgpu_claims_binding_pending{" not in generate_latest(registry).decode()


def test_the_leaders_pass_runs_it_and_exports_the_gauge() -> None:
    state = ClusterState()
    wall = datetime.now(UTC)
    body = waiting()
    body["status"]["allocation"]["allocationTimestamp"] = (wall - timedelta(seconds=300)).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )
    load(state, claims=[body], pods=[pod("p", "c")])
    sink = Sink()
    work = active.ActiveWork(
        state,
        Diagnostics(sink, delay_s=30),
        None,  # type: ignore[arg-type]  # no policy: nothing is written
        lambda: True,
        binding_waits=BindingWaits(sink, grace_s=60),
    )
    try:
        work.tick()
        assert [(k, r) for k, _, r, *_ in sink.events] == [
            ("ResourceClaim", REASON),
            ("Pod", REASON),
        ]
        figures = metrics.POOL._figures
        assert figures is not None
        assert figures.binding_pending[PARTITION_READY_CONDITION] == 1
    finally:
        metrics.POOL.update(None)


def test_the_grace_period_is_a_flag() -> None:
    assert config_from_args(build_parser().parse_args([])).binding_grace_s == 60
    args = build_parser().parse_args(["--binding-grace", "90"])
    assert config_from_args(args).binding_grace_s == 90


# --- flexgpu explain --------------------------------------------------------------------------


def _read(claims: list[Any], pods: list[Any]) -> ClusterRead:
    return ClusterRead(snapshot(claims, pods))


def test_explain_claim_says_what_it_waits_for_since_when() -> None:
    read = _read([waiting(allocated_s_ago=150)], [pod("p", "c"), pod("q", "c", node_name="x")])
    [finding] = cli_explain.explain_claim(read, read.snapshot.claims["ns/c"], NOW)
    assert finding.state == "BindingPending" and finding.blocked
    assert finding.devices == [f"h100/{MIG}"] and finding.nodes == ["h100"]
    assert f"{PARTITION_READY_CONDITION} of device {MIG} on node h100" in finding.message
    assert "allocated at 2026-01-01T11:57:30Z, 2m ago" in finding.message
    assert finding.message.endswith("Pods waiting: ns/p.")


def test_explain_inside_the_grace_period_is_not_blocked_and_met_is_allocated() -> None:
    read = _read([waiting(allocated_s_ago=5)], [pod("p", "c")])
    [young] = cli_explain.explain_claim(read, read.snapshot.claims["ns/c"], NOW)
    assert young.state == "BindingPending" and not young.blocked
    read = _read([waiting(devices=[entry(MIG, PARTITION_READY_CONDITION)])], [pod("p", "c")])
    [met] = cli_explain.explain_claim(read, read.snapshot.claims["ns/c"], NOW)
    assert met.state == "Allocated" and not met.blocked
    assert "binding condition" not in met.message
    # Conditions not met but no pod without a node: nothing waits for them.
    read = _read([waiting()], [pod("p", "c", node_name="h100")])
    [bound] = cli_explain.explain_claim(read, read.snapshot.claims["ns/c"], NOW)
    assert bound.state == "Allocated" and not bound.blocked


def test_explain_pod_says_what_it_waits_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli_explain, "_events", lambda *_: [])
    raw = pod("p", "c", age_s=200)
    read = _read([waiting(allocated_s_ago=3600)], [raw])
    [finding] = cli_explain.explain_pod(None, read, raw, NOW)  # type: ignore[arg-type]
    assert finding.state == "BindingPending" and finding.blocked and finding.entry == "c0"
    assert "Pod ns/p is not bound to a node yet" in finding.message
    assert f"{PARTITION_READY_CONDITION} of device {MIG} on node h100" in finding.message
    assert "1h ago" in finding.message
