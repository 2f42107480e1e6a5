"""Clearing a GPU for a claim that waits on fragmented capacity: which GPU is chosen and why
(``driver.allocation.clearing``), which devices are tainted, the bound on how many GPUs are
steered, and when the taints go (``controller.clearing``)."""

from __future__ import annotations

import tempfile
from fractions import Fraction
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from controller_builders import (
    NOW,
    A,
    claim,
    holding,
    load,
    node,
    node_slices,
    pod,
    request,
    stamp,
)

from flexgpu.controller.clearing import ENDED, STARTED, Clearing, clearing_inputs
from flexgpu.controller.cluster_state import ClusterState, Snapshot
from flexgpu.controller.events import EventTarget
from flexgpu.controller.main import build_parser, config_from_args
from flexgpu.controller.taint_rules import ClearingFor, RuleInfo, rule_body
from flexgpu.driver.allocation.clearing import candidates, steering_limit
from flexgpu.driver.allocation.state import DeviceId
from flexgpu.driver.names import DRIVER_NAME
from flexgpu.driver.resource_slice import slice_specs
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.topology import load_topology
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices

TWO_H100 = {
    "name": "two-h100",
    "description": "2x H100, both partitioned on demand",
    "gpus": [{"model": "H100-SXM5-80GB"} for _ in range(2)],
}
ONE_G = f'{A}.profile == "1g.10gb"'
WHOLE = request("gpu.flexgpu.dev", 1)


@cache
def _devices() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    with tempfile.TemporaryDirectory() as folder:
        topology = Path(folder) / "two.yaml"
        topology.write_text(yaml.safe_dump(TWO_H100))
        backend = SimulatedBackend(load_topology(str(topology)), "n", Path(folder) / "s.json")
        devices = NodeDevices(backend, dynamic_mig={0, 1})
        return devices.slice_devices(), devices.counter_sets()


def slices(name: str) -> list[dict[str, Any]]:
    devices, counters = _devices()
    return [
        {"metadata": {"name": f"{name}-{i}"}, "spec": spec}
        for i, spec in enumerate(slice_specs(name, devices, 1, counters))
    ]


def held(name: str, pool: str, device: str, age_s: float = 600) -> dict[str, Any]:
    body = holding(name, pool, device)
    body["status"]["allocation"]["allocationTimestamp"] = stamp(age_s)
    return body


def mig_devices(gpu: int) -> list[str]:
    devices, _ = _devices()
    return [
        d["name"]
        for d in devices
        if d["name"] == f"gpu-{gpu}" or d["name"].startswith(f"gpu-{gpu}-")
    ]


def world(*holders: dict[str, Any], nodes: tuple[str, ...] = ("n1",), **extra: Any) -> Any:
    return {
        "slices": [s for n in nodes for s in slices(n)],
        "nodes": [node(n) for n in nodes],
        "claims": [claim("big", WHOLE), *holders, *extra.get("claims", [])],
        "pods": [pod("waits", "big"), *extra.get("pods", [])],
    }


def choice(snapshot: Snapshot, claim_key: str = "ns/big") -> list[Any]:
    return candidates(snapshot.claims[claim_key].model, clearing_inputs(snapshot, NOW))


# --- the choice ------------------------------------------------------------------------------


def test_fewest_holders_wins_and_only_devices_the_claim_skips_are_steered() -> None:
    # GPU 0 holds one 1g partition, GPU 1 two: a whole GPU fits nowhere now, on either once
    # its holders end; GPU 0 needs fewer pods to end.
    snap = load(
        ClusterState(),
        **world(
            held("a", "n1", "gpu-0-mig-1g10gb-0"),
            held("b", "n1", "gpu-1-mig-1g10gb-0"),
            held("c", "n1", "gpu-1-mig-1g10gb-1"),
        ),
    )
    found = choice(snap)
    assert [(c.gpu.node, c.holders) for c in found] == [
        ("n1", ("ns/a",)),
        ("n1", ("ns/b", "ns/c")),
    ]
    best = found[0]
    assert best.keep_free == ((DRIVER_NAME, "n1", "gpu-0"),)
    assert {d[2] for d in best.steer} == set(mig_devices(0)) - {"gpu-0"}
    assert best.held_memory == Fraction(9984 * 2**20)


def test_equal_holder_counts_prefer_less_memory_held_then_the_longest_running_holder() -> None:
    smaller = load(
        ClusterState(),
        **world(held("a", "n1", "gpu-0-mig-2g20gb-0"), held("b", "n1", "gpu-1-mig-1g10gb-0")),
    )
    assert [c.holders for c in choice(smaller)] == [("ns/b",), ("ns/a",)]
    older = load(
        ClusterState(),
        **world(
            held("a", "n1", "gpu-0-mig-1g10gb-0", age_s=60),
            held("b", "n1", "gpu-1-mig-1g10gb-0", age_s=3000),
        ),
    )
    assert [c.holders for c in choice(older)] == [("ns/b",), ("ns/a",)]


def test_no_candidate_when_clearing_one_gpu_would_not_be_enough() -> None:
    # Two whole GPUs on a node of two: clearing either one alone leaves the other held.
    snap = load(
        ClusterState(),
        **world(
            held("a", "n1", "gpu-0-mig-1g10gb-0"),
            held("b", "n1", "gpu-1-mig-1g10gb-0"),
            claims=[claim("two", request("gpu.flexgpu.dev", 2))],
        ),
    )
    assert choice(snap, "ns/two") == []


def test_a_gpu_without_holders_is_no_candidate() -> None:
    # GPU 1 is free: nothing to wait for there, so only GPU 0 is named (and the controller
    # asks only for claims that do not fit now, see test_a_claim_that_fits_already...).
    snap = load(ClusterState(), **world(held("a", "n1", "gpu-0-mig-1g10gb-0")))
    assert [c.holders for c in choice(snap)] == [("ns/a",)]


def test_steering_limit_rounds_down_and_rejects_a_share_outside_zero_to_one() -> None:
    assert steering_limit(20, 0.1) == 2
    assert steering_limit(5, 0.1) == 0
    assert steering_limit(10, 0.3) == 3
    with pytest.raises(ValueError, match=r"clearing share 1.5: must be between 0 and 1"):
        steering_limit(10, 1.5)


def test_clearing_share_flag_names_the_bad_value(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--clearing-share=12%"])
    assert "--clearing-share '12%': must be a number from 0 (off) to 1" in capsys.readouterr().err


def test_rule_names_the_device_and_taints_under_flexgpus_key() -> None:
    what = ClearingFor("uid-big", "ns/big", "n1/n1/GPU-x", "2026-01-01T12:00:00Z")
    body = rule_body("v1", what, (DRIVER_NAME, "n1", "gpu-0-mig-1g10gb-0"))
    assert body["apiVersion"] == "resource.k8s.io/v1"
    assert body["spec"]["deviceSelector"] == {
        "driver": DRIVER_NAME,
        "pool": "n1",
        "device": "gpu-0-mig-1g10gb-0",
    }
    assert body["spec"]["taint"]["key"] == "flexgpu.dev/clearing"
    assert body["spec"]["taint"]["effect"] == "NoSchedule"


# --- the controller's passes -----------------------------------------------------------------


class Rules:
    def __init__(self, served: str | None = "v1") -> None:
        self.served = served
        self.rules: dict[str, tuple[ClearingFor, DeviceId]] = {}

    def version(self) -> str | None:
        return self.served

    def list(self) -> list[RuleInfo]:
        return [
            RuleInfo(name, w.claim_uid, w.claim, w.gpu, w.since)
            for name, (w, _) in self.rules.items()
        ]

    def create(self, what: ClearingFor, device: DeviceId) -> str:
        name = f"rule-{device[2]}"
        self.rules[name] = (what, device)
        return name

    def delete(self, name: str) -> None:
        self.rules.pop(name, None)

    def devices(self) -> set[str]:
        return {d[2] for _, d in self.rules.values()}


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, str]] = []

    def emit(
        self,
        target: EventTarget,
        reason: str,
        message: str,
        *,
        repeat: bool,
        event_type: str = "Warning",
    ) -> None:
        self.events.append((target.kind, target.name, reason, event_type))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _clearing(rules: Rules, share: float = 1.0, max_s: float = 600) -> tuple[Clearing, Sink, Clock]:
    sink, clock = Sink(), Clock()
    return Clearing(rules, sink, delay_s=30, share=share, max_s=max_s, clock=clock), sink, clock


FRAGMENTED = (
    held("a", "n1", "gpu-0-mig-1g10gb-0"),
    held("b", "n1", "gpu-1-mig-1g10gb-0"),
    held("c", "n1", "gpu-1-mig-1g10gb-1"),
)


def test_a_pass_taints_the_best_gpu_and_tells_pod_claim_and_node() -> None:
    rules = Rules()
    clearing, sink, _ = _clearing(rules)
    clearing.run_pass(load(ClusterState(), **world(*FRAGMENTED)), NOW)
    assert rules.devices() == set(mig_devices(0)) - {"gpu-0"}
    assert {(w.claim, w.gpu.split("/")[0]) for w, _ in rules.rules.values()} == {("ns/big", "n1")}
    assert sorted(sink.events) == [
        ("Node", "n1", STARTED, "Normal"),
        ("Pod", "waits", STARTED, "Normal"),
        ("ResourceClaim", "big", STARTED, "Normal"),
    ]


def test_the_taints_go_when_the_claim_is_placed() -> None:
    rules = Rules()
    clearing, sink, _ = _clearing(rules)
    state = ClusterState()
    clearing.run_pass(load(state, **world(*FRAGMENTED)), NOW)
    placed = world(*FRAGMENTED[1:])
    placed["claims"][0] = held("big", "n1", "gpu-0")
    clearing.run_pass(load(state, **placed), NOW)
    assert rules.rules == {}
    assert ("ResourceClaim", "big", ENDED, "Normal") in sink.events
    assert clearing.active == {}


def test_the_taints_go_when_no_pod_waits_for_the_claim() -> None:
    rules = Rules()
    clearing, _, _ = _clearing(rules)
    state = ClusterState()
    clearing.run_pass(load(state, **world(*FRAGMENTED)), NOW)
    gone = world(*FRAGMENTED)
    gone["pods"] = []
    clearing.run_pass(load(state, **gone), NOW)
    assert rules.rules == {}


def test_after_the_time_bound_the_taints_go_and_that_claim_is_not_steered_for_again() -> None:
    rules = Rules()
    clearing, _, clock = _clearing(rules, max_s=600)
    state = ClusterState()
    clearing.run_pass(load(state, **world(*FRAGMENTED)), NOW)
    assert rules.rules
    clock.now += 601
    clearing.run_pass(load(state, **world(*FRAGMENTED)), NOW)
    assert rules.rules == {}
    clock.now += 10
    clearing.run_pass(load(state, **world(*FRAGMENTED)), NOW)
    assert rules.rules == {}
    clock.now += 600  # as long again: it may be tried once more
    clearing.run_pass(load(state, **world(*FRAGMENTED)), NOW)
    assert rules.rules


def test_never_more_than_the_share_of_gpus_is_steered() -> None:
    # Two nodes, four GPUs, every GPU holds a partition; two claims wait for a whole GPU.
    # A quarter of four GPUs: one.
    objects = world(
        held("a", "n1", "gpu-0-mig-1g10gb-0"),
        held("b", "n1", "gpu-1-mig-1g10gb-0"),
        held("c", "n2", "gpu-0-mig-1g10gb-0"),
        held("d", "n2", "gpu-1-mig-1g10gb-0"),
        nodes=("n1", "n2"),
        claims=[claim("big2", WHOLE)],
        pods=[pod("waits2", "big2")],
    )
    rules = Rules()
    clearing, _, _ = _clearing(rules, share=0.25)
    clearing.run_pass(load(ClusterState(), **objects), NOW)
    assert len(clearing.active) == 1
    rules = Rules()
    clearing, _, _ = _clearing(rules, share=0.5)
    clearing.run_pass(load(ClusterState(), **objects), NOW)
    assert len(clearing.active) == 2
    assert len({s.gpu for s in clearing.active.values()}) == 2  # one GPU each, not the same
    rules = Rules()
    clearing, _, _ = _clearing(rules, share=0.2)
    clearing.run_pass(load(ClusterState(), **objects), NOW)
    assert clearing.active == {} and rules.rules == {}


def test_a_new_leader_takes_over_the_rules_and_removes_them_when_the_claim_is_placed() -> None:
    rules = Rules()
    first, _, _ = _clearing(rules)
    first.run_pass(load(ClusterState(), **world(*FRAGMENTED)), NOW)
    made = dict(rules.rules)
    second, sink, _ = _clearing(rules)
    state = ClusterState()
    second.run_pass(load(state, **world(*FRAGMENTED)), NOW)
    assert rules.rules == made  # taken over, not steered twice
    placed = world(*FRAGMENTED[1:])
    placed["claims"][0] = held("big", "n1", "gpu-0")
    second.run_pass(load(state, **placed), NOW)
    assert rules.rules == {}
    assert sorted(sink.events) == [
        ("Node", "n1", ENDED, "Normal"),
        ("ResourceClaim", "big", ENDED, "Normal"),
    ]


def test_nothing_is_done_where_no_device_taint_rule_api_is_served() -> None:
    rules = Rules(served=None)
    clearing, sink, _ = _clearing(rules)
    clearing.run_pass(load(ClusterState(), **world(*FRAGMENTED)), NOW)
    assert rules.rules == {} and sink.events == []


def test_a_claim_that_fits_already_gets_no_steering() -> None:
    rules = Rules()
    clearing, _, _ = _clearing(rules)
    clearing.run_pass(load(ClusterState(), **world(held("a", "n1", "gpu-0-mig-1g10gb-0"))), NOW)
    assert rules.rules == {}


def test_a_one_g_claim_is_never_what_a_gpu_is_cleared_for() -> None:
    # A small claim that waits fits once anything ends; here it fits already.
    objects = world(*FRAGMENTED)
    objects["claims"][0] = claim("big", request("mig.flexgpu.dev", 1, ONE_G))
    rules = Rules()
    clearing, _, _ = _clearing(rules)
    clearing.run_pass(load(ClusterState(), **objects), NOW)
    assert rules.rules == {}


def test_the_clearing_flags_reach_the_controllers_configuration() -> None:
    config = config_from_args(
        build_parser().parse_args(["--clearing-share=0.2", "--clearing-max=2h"])
    )
    assert (config.clearing_share, config.clearing_max_s) == (0.2, 7200.0)
    assert config_from_args(build_parser().parse_args([])).clearing_share == 0.0


def test_a_shared_gpu_is_never_cleared_since_the_waiting_claim_would_use_the_same_device() -> None:
    # GPU 0 is shared and holds a 16Gi share; GPU 1 is whole and held. 20Gi of GPU 0 would
    # fit once the share ended, but a taint on its one device would keep the claim off too.
    objects = {
        "slices": node_slices("l4", "l4-2-pcie", shared=(0,)),
        "nodes": [node("l4")],
        "claims": [
            claim(
                "big", request("shared-gpu.flexgpu.dev", capacity={"requests": {"memory": "20Gi"}})
            ),
            holding("share", "l4", "gpu-0", memory="16Gi"),
            holding("hog", "l4", "gpu-1"),
        ],
        "pods": [pod("waits", "big")],
    }
    snap = load(ClusterState(), **objects)
    assert choice(snap) == []
    rules = Rules()
    clearing, _, _ = _clearing(rules)
    clearing.run_pass(snap, NOW)
    assert rules.rules == {}
