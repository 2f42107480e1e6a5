"""Eviction for node steering (``controller.node_eviction`` over ``controller.place_eviction``):
a node steered past the bound is emptied by evicting its holders' pods one at a time, only
when every holder may move and every moving pod fits on another node now; a holder that must
stay keeps them all and the Node says which; a budget's 429 is waited out; the in-flight bound
holds; a steering that ended evicts nothing more; the flags and their bounds."""

from __future__ import annotations

from typing import Any

import pytest
from controller_builders import NOW, claim, load, pod, request
from kubernetes import client
from test_controller_clearing_eviction import OWNERS, Cluster, Evictor, budgets_of
from test_controller_node_steering import BUSY, Clock, Rules, cluster, gpus

from flexgpu.controller.events import EventTarget
from flexgpu.controller.holder_consent import REREAD_S
from flexgpu.controller.main import build_parser, config_from_args, parse_args
from flexgpu.controller.node_eviction import (
    BLOCKED,
    EVICTED,
    EVICTIONS,
    IN_FLIGHT,
    REFUSED,
    WAITS,
    NodeEvictions,
)
from flexgpu.controller.node_steering import (
    ENDED,
    RECHECK_S,
    STARTED,
    NodeSteering,
    SteeredNode,
)
from flexgpu.controller.place_eviction import BLOCKED_RETRY_S
from flexgpu.controller.records import PodRecord
from flexgpu.driver.allocation.consolidation import MOVABLE_ANNOTATION

AFTER_S = 600.0
NODES3 = ("n1", "n2", "n3")
MAX_S = 3600.0


class Sink:
    """Every Event, with its type and whether it may repeat."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, str, str]] = []  # kind, name, reason, type, text

    def emit(
        self,
        target: EventTarget,
        reason: str,
        message: str,
        *,
        repeat: bool,
        event_type: str = "Warning",
    ) -> None:
        self.events.append((target.kind, target.name, reason, event_type, message))

    def said(self, reason: str) -> list[tuple[str, str]]:
        return [(kind, name) for kind, name, r, _, _ in self.events if r == reason]


def holder(
    name: str,
    gpu: int,
    *,
    owner: str | None = "ReplicaSet",
    movable: bool = True,
    deleting: bool = False,
    only_here: bool = False,
    node: str = "n2",
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A claim generated for pod ``<name>-pod`` from a template, allocated whole GPU ``gpu``
    of n2 an hour ago, and that pod bound to n2: owned by ``owner``, annotated movable or
    not; ``only_here``: the pod may run on n2 alone (a node selector)."""
    body = gpus(name, node, 1, first=gpu)
    body["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": f"{name}-pod",
            "uid": f"uid-{name}-pod",
            "controller": True,
        }
    ]
    selector = {"kubernetes.io/hostname": node} if only_here else None
    running = pod(f"{name}-pod", node_name=node, templates={"g": name}, node_selector=selector)
    running["status"]["phase"] = "Running"
    meta = running["metadata"]
    if movable:
        meta["annotations"] = {MOVABLE_ANNOTATION: "true"}
    if owner is not None:
        meta["ownerReferences"] = [
            {
                "apiVersion": OWNERS[owner],
                "kind": owner,
                "name": "w",
                "uid": "uid-w",
                "controller": True,
            }
        ]
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T12:00:00Z"
    return body, running


def world(*pairs: tuple[dict[str, Any], dict[str, Any]], busy: int = 6) -> dict[str, Any]:
    """n1 holds ``busy`` of its 8 GPUs (6: room for two more), over half, so not steered;
    n2 only the given holders: n2 is the node steered."""
    train = BUSY if busy == 6 else gpus("train", "n1", busy)
    return cluster(train, *(c for c, _ in pairs), pods=[p for _, p in pairs])


class Setup:
    def __init__(
        self, *, max_in_flight: int = 1, outcome: str = "evicted", max_s: float = MAX_S
    ) -> None:
        self.rules, self.sink, self.clock = Rules(), Sink(), Clock()
        self.evictor, self.state = Evictor(outcome), Cluster()
        self.evictions = NodeEvictions(
            self.state,
            self.evictor,
            self.sink,
            budgets_of(),
            after_s=AFTER_S,
            max_in_flight=max_in_flight,
            clock=self.clock,
        )
        self.steering = NodeSteering(
            self.rules,
            self.sink,
            share=0.5,
            max_s=max_s,
            evictions=self.evictions,
            clock=self.clock,
        )

    def run(self, objects: dict[str, Any], after_s: float = 0.0) -> list[str]:
        """One pass ``after_s`` later; the pods asked to be evicted so far."""
        self.clock.now += after_s
        self.steering.run_pass(load(self.state, **objects), NOW)
        return self.evictor.calls


def counted(outcome: str) -> float:
    return float(EVICTIONS.labels(outcome)._value.get())


def test_every_holder_moves_one_at_a_time_once_the_node_is_steered_long_enough() -> None:
    s = Setup()
    a, e = holder("a", 0), holder("e", 1)
    assert s.run(world(a, e)) == []
    assert s.rules.nodes() == {"n2"}
    [started] = [m for _, n, r, _, m in s.sink.events if r == STARTED]
    assert "after 10m the pods that opted in may be evicted" in started
    assert s.run(world(a, e), AFTER_S - 1) == []  # not before the bound
    before = counted("evicted")
    assert s.run(world(a, e), 1) == ["ns/a-pod"]
    assert counted("evicted") == before + 1
    assert s.sink.said(EVICTED) == [("Pod", "a-pod"), ("Node", "n2")]
    [message] = {m for _, _, r, _, m in s.sink.events if r == EVICTED}
    assert "emptying node n2 that flexgpu steers so an autoscaler can remove it" in message
    assert 'flexgpu.dev/movable: "true"' in message and "ReplicaSet makes it again" in message
    # In flight while it is there, and while it is being deleted: one at a time.
    assert s.run(world(a, e), 20) == ["ns/a-pod"]
    assert IN_FLIGHT._value.get() == 1
    assert s.run(world(holder("a", 0, deleting=True), e), 20) == ["ns/a-pod"]
    # Gone: the next holder goes.
    assert s.run(world(e), 20) == ["ns/a-pod", "ns/e-pod"]
    assert s.rules.nodes() == {"n2"}  # still steered while it empties


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"owner": "Job"}, "pod ns/j-pod belongs to a Job: a Job's pods are never evicted"),
        ({"movable": False}, "pod ns/j-pod did not consent"),
        ({"owner": None}, "pod ns/j-pod has no controller that makes it again"),
    ],
    ids=["job", "not-opted-in", "bare-pod"],
)
def test_one_holder_that_must_stay_keeps_every_other_and_the_node_says_which(
    kwargs: dict[str, Any], words: str
) -> None:
    s = Setup()
    objects = world(holder("a", 0), holder("j", 1, **kwargs))
    s.run(objects)
    s.run(objects, AFTER_S + 1)
    s.run(objects, 20)
    assert s.evictor.calls == []
    # Said once, on the node, as a Normal Event; not once a pass.
    assert s.sink.said(WAITS) == [("Node", "n2")]
    [(event_type, message)] = [(t, m) for _, _, r, t, m in s.sink.events if r == WAITS]
    assert event_type == "Normal"
    assert "flexgpu evicts nobody from node n2" in message and words in message


def test_nobody_moves_when_one_pod_would_have_nowhere_else_to_go() -> None:
    s = Setup()
    objects = world(holder("a", 0), holder("h", 1, only_here=True))
    s.run(objects)
    assert s.rules.nodes() == {"n2"}
    s.run(objects, AFTER_S + 1)
    assert s.evictor.calls == []
    [message] = [m for _, n, r, _, m in s.sink.events if r == WAITS and n == "n2"]
    assert "pod ns/h-pod would have nowhere to go now" in message


def test_room_on_another_steered_node_is_no_room() -> None:
    """A second steered node's free GPUs are kept off new claims too: a pod that fits only
    there stays."""
    s = Setup()
    objects = world(holder("a", 0))
    steered = [SteeredNode("n2", s.clock.now), SteeredNode("n1", s.clock.now + AFTER_S)]
    s.clock.now += AFTER_S + 1
    s.evictions.run(load(s.state, **objects), steered)
    assert s.evictor.calls == []
    assert s.sink.said(WAITS) == [("Node", "n2")]
    s.clock.now += 20
    s.evictions.run(load(s.state, **objects), steered[:1])
    assert s.evictor.calls == ["ns/a-pod"]


def test_a_disruption_budgets_429_is_told_to_the_pod_and_asked_again_later() -> None:
    s = Setup(outcome="blocked")
    objects = world(holder("a", 0))
    s.run(objects)
    before = counted("blocked")
    assert s.run(objects, AFTER_S + 1) == ["ns/a-pod"]
    assert counted("blocked") == before + 1
    assert s.sink.said(BLOCKED) == [("Pod", "a-pod")]
    assert s.run(objects, 15) == ["ns/a-pod"]  # not every pass
    assert s.run(objects, BLOCKED_RETRY_S) == ["ns/a-pod", "ns/a-pod"]


def test_any_other_refusal_is_a_warning_on_the_pod_and_the_node() -> None:
    s = Setup(outcome="refused")
    objects = world(holder("a", 0))
    s.run(objects)
    assert s.run(objects, AFTER_S + 1) == ["ns/a-pod"]
    assert [(k, n, t) for k, n, r, t, _ in s.sink.events if r == REFUSED] == [
        ("Pod", "a-pod", "Warning"),
        ("Node", "n2", "Warning"),
    ]


def test_never_more_than_max_in_flight_pods_and_a_pod_being_deleted_counts() -> None:
    three = (holder("a", 0), holder("e", 1), holder("f", 2))
    s = Setup(max_in_flight=2)
    s.run(world(*three, busy=5))
    assert s.rules.nodes() == {"n2"}
    assert s.run(world(*three, busy=5), AFTER_S + 1) == ["ns/a-pod", "ns/e-pod"]
    assert s.run(world(*three, busy=5), 20) == ["ns/a-pod", "ns/e-pod"]
    assert s.run(world(three[2], busy=5), 20) == ["ns/a-pod", "ns/e-pod", "ns/f-pod"]
    # A new leader knows nothing it evicted; pods being deleted hold the bound for it.
    s = Setup(max_in_flight=2)
    ending = (holder("a", 0, deleting=True), holder("e", 1, deleting=True), three[2])
    s.run(world(*ending, busy=5))
    assert s.run(world(*ending, busy=5), AFTER_S + 1) == []
    assert s.run(world(ending[0], three[2], busy=5), 20) == ["ns/f-pod"]


def test_a_steering_that_ended_evicts_nothing_more() -> None:
    # Timed out: the steering's bound passes while its first pod is still going.
    s = Setup(max_s=AFTER_S + 30)
    a, e = holder("a", 0), holder("e", 1)
    s.run(world(a, e))
    assert s.run(world(a, e), AFTER_S + 1) == ["ns/a-pod"]
    assert s.run(world(e), 40) == ["ns/a-pod"]
    assert s.rules.nodes() == set()
    assert s.run(world(e), 40) == ["ns/a-pod"]
    assert any(r == ENDED and "did not empty within" in m for _, _, r, _, m in s.sink.events)

    # Released: a claim that fits only on n2 ends its steering before anything is evicted.
    s = Setup()
    s.run(world(a, e))
    s.clock.now += AFTER_S + 1
    objects = world(a, e)
    objects["claims"].append(claim("three", request(count=3)))  # n1 has room for two
    objects["pods"].append(pod("waits", "three", age_s=60))
    assert s.run(objects) == []
    assert s.rules.nodes() == set()
    assert any(r == ENDED and "claim ns/three fits" in m for _, _, r, _, m in s.sink.events)


def test_losing_the_lease_forgets_what_was_in_flight() -> None:
    s = Setup()
    a = holder("a", 0)
    s.run(world(a))
    s.run(world(a), AFTER_S + 1)
    assert IN_FLIGHT._value.get() == 1
    s.steering.forget()
    assert IN_FLIGHT._value.get() == 0 and s.steering.active == {}


# --- configuration ---------------------------------------------------------------------------


def test_the_flags_reach_the_configuration_and_default_to_never() -> None:
    config = config_from_args(
        build_parser().parse_args(
            ["--node-steering-evict-after=15m", "--node-steering-evict-max-in-flight=2"]
        )
    )
    assert (config.node_steering_evict_after_s, config.node_steering_evict_max_in_flight) == (
        900.0,
        2,
    )
    default = config_from_args(build_parser().parse_args([]))
    assert (default.node_steering_evict_after_s, default.node_steering_evict_max_in_flight) == (
        None,
        1,
    )


def test_eviction_after_the_steering_has_ended_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--node-steering-evict-after=1h", "--node-steering-max=1h"])
    assert "--node-steering-evict-after 1h: must be less than --node-steering-max (1h)" in (
        capsys.readouterr().err
    )
    evictions = NodeEvictions(Cluster(), Evictor(), Sink(), budgets_of(), after_s=3600)
    with pytest.raises(ValueError, match=r"eviction after 1h: must be less than .* \(1h\)"):
        NodeSteering(Rules(), Sink(), max_s=3600, evictions=evictions)
    with pytest.raises(ValueError, match=r"node steering eviction maxInFlight 0: must be 1"):
        NodeEvictions(Cluster(), Evictor(), Sink(), budgets_of(), after_s=60, max_in_flight=0)


def test_a_node_whose_holders_may_all_move_is_steered_before_one_holding_a_job() -> None:
    # n3 has fewer holders, but its Job's pod never moves: eviction could not empty it.
    movable = [holder("web-a", 0), holder("web-b", 1)]
    job = holder("train-job", 0, owner="Job", node="n3")
    pairs = (*movable, job)
    objects = cluster(BUSY, *(c for c, _ in pairs), pods=[p for _, p in pairs], nodes=NODES3)
    with_eviction = Setup()
    with_eviction.run(objects)
    assert set(with_eviction.steering.active) == {"n2"}
    # With eviction off nobody may move: fewest holders first, as before.
    rules, sink = Rules(), Sink()
    without = NodeSteering(rules, sink, share=0.5, max_s=MAX_S, clock=Clock())
    without.run_pass(load(Cluster(), **objects), NOW)
    assert set(without.active) == {"n3"}


def test_consent_is_read_once_per_claim_within_the_reread_interval() -> None:
    pairs = (holder("web-a", 0), holder("web-b", 1))
    objects = cluster(BUSY, *(c for c, _ in pairs), pods=[p for _, p in pairs], nodes=NODES3)
    setup = Setup()
    setup.run(objects)
    first = setup.state.reads
    assert first >= 2  # both holders' pods read for the ranking
    setup.run(objects, after_s=RECHECK_S)
    assert setup.state.reads == first  # not past the bound yet: no new reads at all
    setup.run(objects, after_s=REREAD_S)
    assert setup.state.reads > first  # read again: an owner may take consent back


def test_a_failed_read_counts_the_holder_as_staying_and_the_pass_goes_on() -> None:
    class Failing(Cluster):
        def read(self, namespace: str, name: str) -> PodRecord | None:
            self.reads += 1
            raise client.ApiException(status=500, reason="etcd timeout")

    pairs = (holder("web-a", 0), holder("web-b", 1))
    job = holder("train-job", 0, owner="Job", node="n3")
    objects = cluster(
        BUSY, *(c for c, _ in (*pairs, job)), pods=[p for _, p in (*pairs, job)], nodes=NODES3
    )
    state, rules, sink, clock = Failing(), Rules(), Sink(), Clock()
    evictions = NodeEvictions(
        state, Evictor("evicted"), sink, budgets_of(), after_s=AFTER_S, clock=clock
    )
    steering = NodeSteering(rules, sink, share=0.5, max_s=MAX_S, evictions=evictions, clock=clock)
    steering.run_pass(load(state, **objects), NOW)
    # Nobody known to move: ranked as with eviction off (fewest holders), nothing raised.
    assert state.reads >= 1 and set(steering.active) == {"n3"}
    # Past the bound the eviction engine's reads fail too: that node waits, nothing raised.
    clock.now += AFTER_S
    steering.run_pass(load(state, **objects), NOW)
    assert set(steering.active) == {"n3"} and not sink.said(EVICTED)
