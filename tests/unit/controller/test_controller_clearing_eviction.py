"""Eviction for GPU clearing: which holders' pods may move (``driver.allocation.consolidation``)
and when the leader evicts them (``controller.clearing_eviction``): only pods that opted in,
owned by a controller that makes them again, whose claim goes with them; only after the bound;
(consent through a PodDisruptionBudget: test_controller_clearing_consent.py);
never for a claim that was placed or is gone; at most so many in flight; a
PodDisruptionBudget's 429 is waited out."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pytest
from controller_builders import NOW, load, pod
from test_controller_clearing import Clock, Rules, Sink, held, world

from flexgpu.controller.clearing import Clearing
from flexgpu.controller.clearing_eviction import (
    BLOCKED,
    BLOCKED_RETRY_S,
    EVICTED,
    EVICTIONS,
    WAITS,
    Evictions,
)
from flexgpu.controller.cluster_state import ClusterState, Kind
from flexgpu.controller.disruption_budgets import Budgets
from flexgpu.controller.main import build_parser, config_from_args, parse_args
from flexgpu.controller.records import PodRecord, pod_record
from flexgpu.driver.allocation.consolidation import (
    MOVABLE_ANNOTATION,
    Holder,
    HolderPod,
    plan_gpu,
    why_not_movable,
)

AFTER_S = 300.0
MIG = "mig.flexgpu.dev"
OWNERS = {
    "ReplicaSet": "apps/v1",
    "StatefulSet": "apps/v1",
    "ReplicationController": "v1",
    "Job": "batch/v1",
    "DaemonSet": "apps/v1",
}


def holder(
    name: str,
    device: str,
    *,
    owner: str | None = "ReplicaSet",
    movable: bool | str = True,
    generated: bool = True,
    deleting: bool = False,
    phase: str = "Running",
    labels: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A claim for one MIG partition holding ``device`` on n1 and its pod, bound to n1: the
    claim generated for the pod (``generated``), the pod owned by ``owner``, annotated movable
    (True: "true"; a string: that value) or not (False), with ``labels``. GPU 1 has room for
    such a claim, so a moved pod has somewhere to go."""
    body = held(name, "n1", device)
    body["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = MIG
    running = pod(f"{name}-pod", node_name="n1", templates={"g": name})
    running["status"]["phase"] = phase
    if generated:
        body["metadata"]["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": f"{name}-pod",
                "uid": f"uid-{name}-pod",
                "controller": True,
            }
        ]
    meta = running["metadata"]
    if labels:
        meta["labels"] = labels
    if movable:
        meta["annotations"] = {MOVABLE_ANNOTATION: "true" if movable is True else movable}
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


# GPU 1 holds three plain claims: GPU 0 (fewer holders) is the one cleared.
GPU1 = tuple(held(n, "n1", f"gpu-1-mig-1g10gb-{i}") for i, n in enumerate(("b", "c", "d")))


def objects(*pairs: tuple[dict[str, Any], dict[str, Any]]) -> dict[str, Any]:
    return world(*GPU1, *(c for c, _ in pairs), pods=[p for _, p in pairs])


class Evictor:
    def __init__(self, outcome: str = "evicted") -> None:
        self.outcome = outcome
        self.calls: list[str] = []

    def evict(self, namespace: str, name: str, uid: str) -> tuple[str, str]:
        self.calls.append(f"{namespace}/{name}")
        return self.outcome, "Cannot evict pod as it would violate the pod's disruption budget."


class Cluster(ClusterState):
    """The controller's cache as the watches fill it: only pods that wait for a node. Bound
    pods (the holders') are what a read from the API server returns."""

    def __init__(self) -> None:
        super().__init__()
        self.bound: dict[str, PodRecord] = {}
        self.reads = 0

    def replace(self, kind: Kind, objects: Iterable[Mapping[str, Any]]) -> None:
        listed = list(objects)
        if kind == "pods":
            bound = [p for p in listed if p["spec"].get("nodeName")]
            self.bound = {
                f"{p['metadata']['namespace']}/{p['metadata']['name']}": r
                for p in bound
                if (r := pod_record(p)) is not None
            }
            listed = [p for p in listed if not p["spec"].get("nodeName")]
        super().replace(kind, listed)

    def read(self, namespace: str, name: str) -> PodRecord | None:
        self.reads += 1
        return self.bound.get(f"{namespace}/{name}")


def budgets_of(*listed: dict[str, Any]) -> Budgets:
    """The budgets as the watch lists them."""
    budgets = Budgets()
    budgets.replace("budgets", listed)
    return budgets


def setup(
    max_in_flight: int = 1,
    outcome: str = "evicted",
    budgets: Budgets | None = None,
    sink: Sink | None = None,
) -> tuple[Clearing, Evictor, Sink, Clock, Cluster]:
    sink, clock, evictor, state = sink or Sink(), Clock(), Evictor(outcome), Cluster()
    evictions = Evictions(
        state,
        evictor,
        sink,
        budgets or budgets_of(),
        after_s=AFTER_S,
        max_in_flight=max_in_flight,
        clock=clock,
    )
    clearing = Clearing(
        Rules(), sink, delay_s=30, share=1.0, max_s=3600, evictions=evictions, clock=clock
    )
    return clearing, evictor, sink, clock, state


def counted(outcome: str) -> float:
    return float(EVICTIONS.labels(outcome)._value.get())


# --- the decision ----------------------------------------------------------------------------


@pytest.mark.parametrize("owner", ["ReplicaSet", "StatefulSet", "ReplicationController"])
def test_a_pod_that_opted_in_and_is_made_again_may_move(owner: str) -> None:
    _, running = holder("a", "gpu-0-mig-1g10gb-0", owner=owner)
    kind = f"{owner}.apps" if owner != "ReplicationController" else owner
    pod_ = HolderPod("ns", "a-pod", "uid-a-pod", "true", kind, False)
    assert running["metadata"]["ownerReferences"][0]["kind"] == owner
    assert why_not_movable(Holder("ns/a", pod_)) is None


@pytest.mark.parametrize(
    ("movable", "controller", "generated", "words"),
    [
        ("true", "Job.batch", True, "belongs to a Job: a Job's pods are never evicted"),
        ("true", "", True, "has no controller that makes it again"),
        ("true", "DaemonSet.apps", True, "owned by a DaemonSet.apps, not known to make it again"),
        (
            None,
            "ReplicaSet.apps",
            True,
            'did not consent: it carries no flexgpu.dev/movable: "true" and no '
            "PodDisruptionBudget of its namespace selects it",
        ),
        ("true", "ReplicaSet.apps", False, "is not generated for one pod"),
    ],
    ids=["job", "bare-pod", "daemonset", "not-opted-in", "claim-by-name"],
)
def test_what_never_moves_says_why(
    movable: str | None, controller: str, generated: bool, words: str
) -> None:
    pod_ = HolderPod("ns", "a-pod", "uid-a-pod", movable, controller, False)
    reason = why_not_movable(Holder("ns/a", pod_ if generated else None, generated))
    assert reason is not None and words in reason


def test_one_holder_that_must_end_keeps_every_other_in_place() -> None:
    movable = HolderPod("ns", "a-pod", "u1", "true", "ReplicaSet.apps", False)
    job = HolderPod("ns", "j-pod", "u2", "true", "Job.batch", False)
    plan = plan_gpu([Holder("ns/a", movable), Holder("ns/j", job)])
    assert plan.evict == () and [c for c, _ in plan.waits_for] == ["ns/j"]
    ended = HolderPod("ns", "j-pod", "u2", "true", "Job.batch", True)
    plan = plan_gpu([Holder("ns/a", movable), Holder("ns/j", ended)])
    assert plan.evict == (movable,) and plan.ending == (ended,)
    # A pod with two claims on the GPU is evicted once.
    plan = plan_gpu([Holder("ns/a", movable), Holder("ns/a2", movable)])
    assert plan.evict == (movable,)
    # The Job's pod is gone and its claim not yet: that claim follows its pod, nothing waits.
    plan = plan_gpu([Holder("ns/a", movable), Holder("ns/j", None)])
    assert plan.evict == (movable,) and plan.waits_for == ()


# --- the leader's passes ---------------------------------------------------------------------


@pytest.mark.parametrize("owner", ["ReplicaSet", "StatefulSet", "ReplicationController"])
def test_a_pod_that_may_move_is_evicted_once_the_bound_has_passed_and_not_before(
    owner: str,
) -> None:
    clearing, evictor, sink, clock, state = setup()
    world_ = objects(holder("a", "gpu-0-mig-1g10gb-0", owner=owner))
    clearing.run_pass(load(state, **world_), NOW)
    assert [s.gpu.split("/")[0] for s in clearing.active.values()] == ["n1"]
    clock.now += AFTER_S - 1
    clearing.run_pass(load(state, **world_), NOW)
    assert evictor.calls == []
    before = counted("evicted")
    clock.now += 1
    clearing.run_pass(load(state, **world_), NOW)
    assert evictor.calls == ["ns/a-pod"]
    assert counted("evicted") == before + 1
    told = {(kind, name) for kind, name, reason, _ in sink.events if reason == EVICTED}
    assert told == {("Pod", "a-pod"), ("Node", "n1"), ("ResourceClaim", "big")}
    # Evicted once: the next pass, the pod still shown, does not ask again.
    clock.now += 20
    clearing.run_pass(load(state, **world_), NOW)
    assert evictor.calls == ["ns/a-pod"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"owner": "Job"},
        {"owner": None},
        {"owner": "DaemonSet"},
        {"movable": False},
        {"movable": "yes"},
        {"generated": False},
    ],
    ids=["job", "bare-pod", "daemonset", "not-opted-in", "annotation-not-true", "claim-by-name"],
)
def test_a_pod_that_may_not_move_is_left_to_end_and_the_claim_is_told_why(
    kwargs: dict[str, Any],
) -> None:
    clearing, evictor, sink, clock, state = setup()
    world_ = objects(holder("a", "gpu-0-mig-1g10gb-0", **kwargs))
    clearing.run_pass(load(state, **world_), NOW)
    clock.now += AFTER_S + 1
    clearing.run_pass(load(state, **world_), NOW)
    clock.now += 20
    clearing.run_pass(load(state, **world_), NOW)
    assert evictor.calls == []
    assert [(k, n) for k, n, reason, _ in sink.events if reason == WAITS] == [
        ("ResourceClaim", "big")  # said once, not every pass
    ]


def test_a_job_pod_on_the_gpu_keeps_the_deployment_pod_until_it_ends() -> None:
    clearing, evictor, _, clock, state = setup()
    deployment = holder("a", "gpu-0-mig-1g10gb-0")
    job = holder("j", "gpu-0-mig-1g10gb-1", owner="Job")
    clearing.run_pass(load(state, **objects(deployment, job)), NOW)
    clock.now += AFTER_S + 1
    clearing.run_pass(load(state, **objects(deployment, job)), NOW)
    assert evictor.calls == []
    # The Job's pod ends (deleted, its claim still held while it goes): now only pods that
    # may move hold the GPU.
    ending = holder("j", "gpu-0-mig-1g10gb-1", owner="Job", deleting=True)
    clock.now += 20
    clearing.run_pass(load(state, **objects(deployment, ending)), NOW)
    assert evictor.calls == []  # the Job pod's deletion is in flight: one at a time
    clock.now += 20
    clearing.run_pass(load(state, **objects(deployment)), NOW)
    assert evictor.calls == ["ns/a-pod"]


def test_at_most_max_in_flight_pods_are_being_evicted_at_once() -> None:
    pods = (holder("a", "gpu-0-mig-1g10gb-0"), holder("e", "gpu-0-mig-1g10gb-1"))
    clearing, evictor, _, clock, state = setup(max_in_flight=1)
    clearing.run_pass(load(state, **objects(*pods)), NOW)
    clock.now += AFTER_S + 1
    clearing.run_pass(load(state, **objects(*pods)), NOW)
    assert evictor.calls == ["ns/a-pod"]
    clock.now += 20  # still there, then being deleted: in flight either way
    clearing.run_pass(load(state, **objects(*pods)), NOW)
    ending = holder("a", "gpu-0-mig-1g10gb-0", deleting=True)
    clock.now += 20
    clearing.run_pass(load(state, **objects(ending, pods[1])), NOW)
    assert evictor.calls == ["ns/a-pod"]
    clock.now += 20  # gone: the next one goes
    clearing.run_pass(load(state, **objects(pods[1])), NOW)
    assert evictor.calls == ["ns/a-pod", "ns/e-pod"]

    clearing, evictor, _, clock, state = setup(max_in_flight=2)
    clearing.run_pass(load(state, **objects(*pods)), NOW)
    clock.now += AFTER_S + 1
    clearing.run_pass(load(state, **objects(*pods)), NOW)
    assert evictor.calls == ["ns/a-pod", "ns/e-pod"]


def test_a_finished_pod_whose_claim_is_still_held_is_no_eviction_in_flight() -> None:
    pods = (holder("a", "gpu-0-mig-1g10gb-0", phase="Succeeded"), holder("e", "gpu-0-mig-1g10gb-1"))
    clearing, evictor, _, clock, state = setup(max_in_flight=1)
    clearing.run_pass(load(state, **objects(*pods)), NOW)
    clock.now += AFTER_S + 1
    clearing.run_pass(load(state, **objects(*pods)), NOW)
    assert evictor.calls == ["ns/e-pod"]


def test_pods_are_read_at_most_every_ten_seconds_however_often_the_cluster_changes() -> None:
    clearing, _, _, clock, state = setup(outcome="blocked")
    world_ = objects(holder("a", "gpu-0-mig-1g10gb-0"))
    clearing.run_pass(load(state, **world_), NOW)
    assert state.reads == 0  # nothing past the bound: nothing read
    clock.now += AFTER_S
    for _ in range(20):  # a pass a second, each over a changed snapshot
        clearing.run_pass(load(state, **world_), NOW)
        clock.now += 1
    assert state.reads == 2


def test_a_new_leader_counts_a_pod_being_deleted_as_in_flight() -> None:
    pods = (holder("a", "gpu-0-mig-1g10gb-0", deleting=True), holder("e", "gpu-0-mig-1g10gb-1"))
    clearing, evictor, _, clock, state = setup(max_in_flight=1)
    clearing.run_pass(load(state, **objects(*pods)), NOW)
    clock.now += AFTER_S + 1
    clearing.run_pass(load(state, **objects(*pods)), NOW)
    assert evictor.calls == []


def test_a_disruption_budgets_refusal_is_recorded_and_asked_again_later() -> None:
    clearing, evictor, sink, clock, state = setup(outcome="blocked")
    world_ = objects(holder("a", "gpu-0-mig-1g10gb-0"))
    clearing.run_pass(load(state, **world_), NOW)
    before = counted("blocked")
    clock.now += AFTER_S + 1
    clearing.run_pass(load(state, **world_), NOW)
    assert evictor.calls == ["ns/a-pod"] and counted("blocked") == before + 1
    assert [(k, n) for k, n, reason, _ in sink.events if reason == BLOCKED] == [("Pod", "a-pod")]
    clock.now += 15  # not every pass
    clearing.run_pass(load(state, **world_), NOW)
    assert evictor.calls == ["ns/a-pod"]
    clock.now += BLOCKED_RETRY_S
    clearing.run_pass(load(state, **world_), NOW)
    assert evictor.calls == ["ns/a-pod", "ns/a-pod"]


def test_nothing_is_evicted_for_a_claim_that_was_placed_or_is_gone() -> None:
    for change in ("placed", "gone"):
        clearing, evictor, _, clock, state = setup()
        pair = holder("a", "gpu-0-mig-1g10gb-0")
        clearing.run_pass(load(state, **objects(pair)), NOW)
        later = objects(pair)
        if change == "placed":
            later["claims"][0] = held("big", "n1", "gpu-0")
        else:
            later["pods"] = [p for p in later["pods"] if p["metadata"]["name"] != "waits"]
        clock.now += AFTER_S + 1
        clearing.run_pass(load(state, **later), NOW)
        assert evictor.calls == [], change
        assert clearing.active == {}, change


def test_eviction_itself_skips_a_steering_whose_claim_is_allocated() -> None:
    # The guard does not rely on the pass having ended that steering first.
    clearing, _, _, clock, state = setup()
    pair = holder("a", "gpu-0-mig-1g10gb-0")
    clearing.run_pass(load(state, **objects(pair)), NOW)
    (steering,) = clearing.active.values()
    evictor = Evictor()
    evictions = Evictions(state, evictor, Sink(), budgets_of(), after_s=AFTER_S, clock=clock)
    clock.now += AFTER_S + 1
    placed = objects(pair)
    placed["claims"][0] = held("big", "n1", "gpu-0")
    evictions.run(load(state, **placed), [steering])
    assert evictor.calls == []
    evictions.run(load(state, **objects(pair)), [steering])
    assert evictor.calls == ["ns/a-pod"]  # the same steering, its claim still waiting


# --- configuration ---------------------------------------------------------------------------


def test_the_eviction_flags_reach_the_configuration_and_default_to_never() -> None:
    config = config_from_args(
        build_parser().parse_args(
            ["--clearing-evict-after=10m", "--clearing-evict-max-in-flight=2"]
        )
    )
    assert (config.clearing_evict_after_s, config.clearing_evict_max_in_flight) == (600.0, 2)
    default = config_from_args(build_parser().parse_args([]))
    assert (default.clearing_evict_after_s, default.clearing_evict_max_in_flight) == (None, 1)


@pytest.mark.parametrize(
    ("flag", "words"),
    [
        ("--clearing-evict-after=0s", "--clearing-evict-after '0s': must be a duration of more"),
        ("--clearing-evict-after=ten", "--clearing-evict-after: 'ten' is not a duration"),
        (
            "--clearing-evict-max-in-flight=0",
            "--clearing-evict-max-in-flight '0': must be a whole number of 1 or more",
        ),
    ],
)
def test_a_bad_eviction_flag_names_itself_and_what_is_allowed(
    flag: str, words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([flag])
    assert words in capsys.readouterr().err


def test_eviction_after_the_steering_has_ended_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--clearing-evict-after=2h", "--clearing-max=1h"])
    assert "--clearing-evict-after 2h: must be less than --clearing-max (1h)" in (
        capsys.readouterr().err
    )
    evictions = Evictions(Cluster(), Evictor(), Sink(), budgets_of(), after_s=3600)
    with pytest.raises(ValueError, match=r"eviction after 3600s: must be less than .*3600s"):
        Clearing(Rules(), Sink(), delay_s=30, max_s=3600, evictions=evictions)
