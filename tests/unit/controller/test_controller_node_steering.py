"""Node steering driven by the controller (``controller.node_steering``): which nodes get a
rule, when the rules go (a claim that fits only there, the time bound, a fuller node, GPU
clearing), the bound, what a new leader takes over, and what a claim holds in
GPU-equivalents (``driver.allocation.node_holders``)."""

from __future__ import annotations

from typing import Any

import pytest
from controller_builders import NOW, claim, holding, load, node, node_slices, pod, request, stamp
from test_controller_clearing import held, mig_devices, slices

from flexgpu.controller.cluster_state import ClusterState, Snapshot
from flexgpu.controller.events import EventTarget
from flexgpu.controller.main import build_parser, config_from_args
from flexgpu.controller.node_steering import ENDED, STARTED, NodeSteering
from flexgpu.controller.taint_rules import (
    STEERING_LABEL,
    STEERING_TAINT_KEY,
    SteeringFor,
    SteeringRule,
    steering_rule_body,
)
from flexgpu.driver.allocation.node_holders import group_nodes
from flexgpu.driver.names import DRIVER_NAME

H100_8 = "hgx-h100-8"


class Rules:
    """The API server's DeviceTaintRules as far as node steering uses them."""

    def __init__(self, served: str | None = "v1") -> None:
        self.served = served
        self.rules: dict[str, tuple[SteeringFor, str]] = {}  # name -> (what, pool)
        self.created = 0

    def version(self) -> str | None:
        return self.served

    def list_steering(self) -> list[SteeringRule]:
        return [SteeringRule(name, w.node, w.since) for name, (w, _) in self.rules.items()]

    def steer(self, what: SteeringFor, driver: str, pool: str) -> str:
        assert driver == DRIVER_NAME
        name = f"steer-{pool}"
        self.rules[name] = (what, pool)
        self.created += 1
        return name

    def delete(self, name: str) -> None:
        self.rules.pop(name, None)

    def nodes(self) -> set[str]:
        return {w.node for w, _ in self.rules.values()}


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, str]] = []  # kind, name, reason, message

    def emit(
        self,
        target: EventTarget,
        reason: str,
        message: str,
        *,
        repeat: bool,
        event_type: str = "Warning",
    ) -> None:
        assert event_type == "Normal"
        self.events.append((target.kind, target.name, reason, message))

    def reasons(self) -> list[tuple[str, str]]:
        return [(name, reason) for _, name, reason, _ in self.events]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def steering(
    rules: Rules, share: float = 0.5, max_s: float = 3600
) -> tuple[NodeSteering, Sink, Clock]:
    sink, clock = Sink(), Clock()
    return NodeSteering(rules, sink, share=share, max_s=max_s, clock=clock), sink, clock


def gpus(name: str, node_name: str, count: int, first: int = 0) -> dict[str, Any]:
    """A claim allocated ``count`` whole GPUs of the node, an hour ago."""
    body = holding(name, node_name, *(f"gpu-{i}" for i in range(first, first + count)))
    body["status"]["allocation"]["allocationTimestamp"] = stamp(3600)
    return body


def cluster(*claims: dict[str, Any], nodes: tuple[str, ...] = ("n1", "n2"), **extra: Any) -> Any:
    return {
        "slices": [s for n in nodes for s in node_slices(n, H100_8)],
        "nodes": [node(n) for n in nodes],
        "claims": list(claims) + extra.get("claims", []),
        "pods": extra.get("pods", []),
    }


def snap(state: ClusterState, *claims: dict[str, Any], **extra: Any) -> Snapshot:
    return load(state, **cluster(*claims, **extra))


# n1 is busy (6 of 8), n2 nearly empty (1 of 8): n1's 2 free GPUs can take n2's one.
BUSY = gpus("train", "n1", 6)
SMALL = gpus("small", "n2", 1)


def test_off_by_default_and_the_flags_reach_the_configuration() -> None:
    assert config_from_args(build_parser().parse_args([])).node_steering_share == 0.0
    config = config_from_args(
        build_parser().parse_args(
            [
                "--node-steering-share=0.5",
                "--node-steering-max-held-share=0.25",
                "--node-steering-max=30m",
            ]
        )
    )
    assert (
        config.node_steering_share,
        config.node_steering_max_held_share,
        config.node_steering_max_s,
    ) == (0.5, 0.25, 1800.0)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--node-steering-share=half", "--node-steering-share 'half': must be a number from 0"),
        (
            "--node-steering-max-held-share=1.5",
            "--node-steering-max-held-share '1.5': must be a number from 0 (only empty nodes) to 1",
        ),
        ("--node-steering-max=0s", "--node-steering-max '0s': must be a duration of more than 0"),
        (
            "--node-steering-evict-after=0s",
            "--node-steering-evict-after '0s': must be a duration of more than 0, such as 10m",
        ),
        ("--node-steering-evict-after=soon", "--node-steering-evict-after: 'soon' is not a"),
        (
            "--node-steering-evict-max-in-flight=0",
            "--node-steering-evict-max-in-flight '0': must be a whole number of 1 or more",
        ),
    ],
)
def test_bad_flags_name_flag_value_and_what_is_allowed(
    flag: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([flag])
    assert message in capsys.readouterr().err


def test_node_labels_flag_names_the_group_and_bad_ones_are_refused_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(["--node-steering-nodes=karpenter.sh/nodepool=gpu, a=b"])
    assert config_from_args(args).node_steering_nodes == {"karpenter.sh/nodepool": "gpu", "a": "b"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--node-steering-nodes=pool"])
    err = capsys.readouterr().err
    assert "--node-steering-nodes 'pool': 'pool' is not key=value" in err
    assert "allowed is key=value[,key=value]" in err


def test_only_the_named_group_is_steered_and_counted_as_room() -> None:
    """n2 (nearly empty) is in the autoscaled group, n1 (with room) is a fixed node: n2 is
    not steered, since the group has nowhere else for its claim; n3, a second node of the
    group with room, makes n2 steerable again."""
    group = {"pool": "autoscaled"}

    def labelled(*names: str) -> list[dict[str, Any]]:
        return [node(n, labels=group if n != "n1" else None) for n in names]

    rules, state = Rules(), ClusterState()
    steer = NodeSteering(rules, Sink(), share=0.5, node_labels=group, clock=Clock())
    two = cluster(BUSY, SMALL)
    two["nodes"] = labelled("n1", "n2")
    steer.run_pass(load(state, **two), NOW)
    assert rules.rules == {}
    three = cluster(BUSY, SMALL, gpus("half", "n3", 4), nodes=("n1", "n2", "n3"))
    three["nodes"] = labelled("n1", "n2", "n3")
    steer.run_pass(load(state, **three), NOW)
    assert rules.nodes() == {"n2"}


def test_the_rule_selects_every_device_of_the_nodes_pool_under_its_own_key() -> None:
    body = steering_rule_body("v1", SteeringFor("n2", "2026-01-01T12:00:00Z"), DRIVER_NAME, "n2")
    assert body["spec"]["deviceSelector"] == {"driver": DRIVER_NAME, "pool": "n2"}
    assert body["spec"]["taint"] == {"key": STEERING_TAINT_KEY, "effect": "NoSchedule"}
    assert body["metadata"]["labels"] == {"flexgpu.dev/clearing": "true", STEERING_LABEL: "true"}
    assert body["metadata"]["annotations"]["flexgpu.dev/node-steering-node"] == "n2"


def test_the_emptier_node_is_steered_and_its_node_told_why() -> None:
    rules = Rules()
    steer, sink, _ = steering(rules)
    steer.run_pass(snap(ClusterState(), BUSY, SMALL), NOW)
    assert rules.nodes() == {"n2"}
    assert {pool for _, pool in rules.rules.values()} == {"n2"}
    [(kind, name, reason, message)] = sink.events
    assert (kind, name, reason) == ("Node", "n2", STARTED)
    assert "it holds 1 of its 8 GPUs for 1 claim(s) (ns/small)" in message
    assert "other nodes have 2 GPUs free" in message


def test_nothing_is_steered_when_the_rest_has_no_room() -> None:
    rules = Rules()
    steer, sink, _ = steering(rules)
    steer.run_pass(snap(ClusterState(), gpus("train", "n1", 8), SMALL), NOW)
    assert rules.rules == {} and sink.events == []


def test_a_node_holding_more_than_the_max_held_share_is_not_steered() -> None:
    rules = Rules()
    steer, _, _ = steering(rules)
    steer.run_pass(snap(ClusterState(), gpus("a", "n1", 2), gpus("b", "n2", 5)), NOW)
    assert rules.nodes() == {"n1"}  # n2 holds 5 of 8, over half


def test_a_claim_that_fits_only_on_the_steered_node_releases_it_while_it_waits() -> None:
    rules = Rules()
    steer, sink, clock = steering(rules)
    state = ClusterState()
    steer.run_pass(snap(state, BUSY, SMALL), NOW)
    assert rules.nodes() == {"n2"}
    # Three GPUs: n1 has two free, so only n2 can take it.
    waiting = {"claims": [claim("three", request(count=3))], "pods": [pod("p", "three")]}
    steer.run_pass(snap(state, BUSY, SMALL, **waiting), NOW)
    assert rules.rules == {}
    assert sink.reasons()[-1] == ("n2", ENDED)
    assert "claim ns/three fits on no other node now" in sink.events[-1][3]
    # While it waits, the node stays released (the next pass finds the same).
    clock.now += 60
    steer.run_pass(snap(state, BUSY, SMALL, **waiting), NOW)
    assert rules.rules == {}
    # Placed: n2 holds 4 of 8, more than n1's 2 free GPUs could take, so it stays unsteered.
    placed = gpus("three", "n2", 3, first=1)
    steer.run_pass(snap(state, BUSY, SMALL, placed), NOW)
    assert rules.rules == {}
    # Once it ends, n2 is the emptier node again.
    clock.now += 60
    steer.run_pass(snap(state, BUSY, SMALL), NOW)
    assert rules.nodes() == {"n2"}


def test_a_claim_that_fits_on_an_unsteered_node_releases_nothing() -> None:
    rules = Rules()
    steer, _, _ = steering(rules)
    state = ClusterState()
    steer.run_pass(snap(state, BUSY, SMALL), NOW)
    waiting = {"claims": [claim("one", request())], "pods": [pod("p", "one")]}
    steer.run_pass(snap(state, BUSY, SMALL, **waiting), NOW)
    assert rules.nodes() == {"n2"}


def test_a_young_pending_pod_releases_nothing_yet() -> None:
    # The scheduler has not had its try: it may still place the claim elsewhere.
    rules = Rules()
    steer, _, _ = steering(rules)
    state = ClusterState()
    steer.run_pass(snap(state, BUSY, SMALL), NOW)
    waiting = {"claims": [claim("three", request(count=3))], "pods": [pod("p", "three", age_s=1)]}
    steer.run_pass(snap(state, BUSY, SMALL, **waiting), NOW)
    assert rules.nodes() == {"n2"}


def test_a_new_leader_takes_over_the_rules_and_removes_them_when_the_node_fills() -> None:
    rules = Rules()
    first, _, _ = steering(rules)
    first.run_pass(snap(ClusterState(), BUSY, SMALL), NOW)
    made = dict(rules.rules)
    second, sink, _ = steering(rules)
    state = ClusterState()
    second.run_pass(snap(state, BUSY, SMALL), NOW)
    assert rules.rules == made and rules.created == 1  # taken over, not created again
    assert sink.events == []
    # n2 now holds 5 of 8: over the held share, no longer steered.
    second.run_pass(snap(state, BUSY, SMALL, gpus("more", "n2", 4, first=1)), NOW)
    assert rules.rules == {}
    assert sink.reasons() == [("n2", ENDED)]


def test_never_more_than_the_share_of_gpus_is_steered() -> None:
    nodes = ("n1", "n2", "n3", "n4")
    objects = (gpus("a", "n1", 5), gpus("b", "n2", 1), gpus("c", "n3", 1), gpus("d", "n4", 1))
    counts = {}
    for share in (0.2, 0.25, 0.5):
        rules = Rules()
        steer, _, _ = steering(rules, share=share)
        steer.run_pass(snap(ClusterState(), *objects, nodes=nodes), NOW)
        counts[share] = len(rules.nodes())
    # 32 GPUs: 0.2 is 6 GPUs, less than one node; 0.25 one node; 0.5 two.
    assert counts == {0.2: 0, 0.25: 1, 0.5: 2}


def test_after_the_time_bound_the_node_rests_as_long_again() -> None:
    rules = Rules()
    steer, sink, clock = steering(rules, max_s=600)
    state = ClusterState()
    steer.run_pass(snap(state, BUSY, SMALL), NOW)
    clock.now += 601
    steer.run_pass(snap(state, BUSY, SMALL), NOW)
    assert rules.rules == {}
    assert "it did not empty within 10m" in sink.events[-1][3]
    clock.now += 300
    steer.run_pass(snap(state, BUSY, SMALL), NOW)
    assert rules.rules == {}
    clock.now += 301
    steer.run_pass(snap(state, BUSY, SMALL), NOW)
    assert rules.nodes() == {"n2"}


def test_a_node_where_a_gpu_is_cleared_is_not_steered() -> None:
    rules = Rules()
    steer, sink, _ = steering(rules)
    state = ClusterState()
    steer.run_pass(snap(state, BUSY, SMALL), NOW)
    steer.run_pass(snap(state, BUSY, SMALL), NOW, cleared_nodes={"n2"})
    assert rules.rules == {}
    assert "GPU clearing empties one of its GPUs" in sink.events[-1][3]


def test_a_deleted_node_ends_its_steering() -> None:
    rules = Rules()
    steer, sink, _ = steering(rules)
    state = ClusterState()
    # 24 GPUs, half of them: one node, the empty n3 first.
    steer.run_pass(snap(state, BUSY, SMALL, nodes=("n1", "n2", "n3")), NOW)
    assert rules.nodes() == {"n3"}
    steer.run_pass(snap(state, BUSY, SMALL), NOW)  # the autoscaler removed n3
    assert rules.nodes() == {"n2"}
    assert sink.reasons() == [("n3", STARTED), ("n3", ENDED), ("n2", STARTED)]
    assert "no flexgpu GPUs any more" in sink.events[1][3]


def test_nothing_is_done_where_no_device_taint_rule_api_is_served() -> None:
    rules = Rules(served=None)
    steer, sink, _ = steering(rules)
    steer.run_pass(snap(ClusterState(), BUSY, SMALL), NOW)
    assert rules.rules == {} and sink.events == []


def test_the_share_and_bounds_are_validated() -> None:
    with pytest.raises(ValueError, match=r"node steering share 2: must be between 0 and 1"):
        NodeSteering(Rules(), Sink(), share=2)
    with pytest.raises(ValueError, match=r"node steering max duration 0: must be more than 0"):
        NodeSteering(Rules(), Sink(), max_s=0)


# --- GPU-equivalents -------------------------------------------------------------------------


def test_a_partition_holds_its_memory_slices_and_a_share_its_memory() -> None:
    state = ClusterState()
    mig = load(
        state,
        slices=slices("m"),
        nodes=[node("m")],
        claims=[held("one", "m", "gpu-0-mig-1g10gb-0"), held("three", "m", "gpu-1-mig-3g40gb-0")],
    )
    [described] = group_nodes(
        mig.node_models, mig.claim_models, mig.slice_index, {"ns/one": 5.0}, DRIVER_NAME
    )
    assert described.gpus == 2
    assert [(h.claim, h.gpus, h.age_s) for h in described.holders] == [
        ("ns/one", 1 / 8, 5.0),
        ("ns/three", 4 / 8, 0.0),
    ]
    assert "gpu-0-mig-1g10gb-0" in mig_devices(0)
    shared = load(
        ClusterState(),
        slices=node_slices("l4", "l4-2-pcie", shared=(0,)),
        nodes=[node("l4")],
        claims=[holding("share", "l4", "gpu-0", memory="11517Mi"), holding("hog", "l4", "gpu-1")],
    )
    [l4] = group_nodes(shared.node_models, shared.claim_models, shared.slice_index, {}, DRIVER_NAME)
    assert {h.claim: h.gpus for h in l4.holders} == {"ns/share": 0.5, "ns/hog": 1.0}
    assert l4.held == 1.5


def test_a_node_without_flexgpu_gpus_is_not_in_the_group() -> None:
    objects = load(
        ClusterState(), slices=node_slices("n1", H100_8), nodes=[node("n1"), node("cpu")]
    )
    described = group_nodes(
        objects.node_models, objects.claim_models, objects.slice_index, {}, DRIVER_NAME
    )
    assert [n.name for n in described] == ["n1"]
