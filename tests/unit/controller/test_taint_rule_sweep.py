"""Rules left by a feature turned off are deleted by the leader, once per leadership; the
rules of a feature that is on are never touched; a refused sweep is tried again later."""

from __future__ import annotations

from kubernetes import client

from flexgpu.controller.taint_rule_sweep import LeftoverRules
from flexgpu.controller.taint_rules import RuleInfo, SteeringRule


class Rules:
    """The API server's DeviceTaintRules as the sweep sees them, both kinds."""

    def __init__(self) -> None:
        self.clearing = [RuleInfo("clear-1", "uid", "ns/big", "node-a/node-a/GPU-1", "t")]
        self.steering = [SteeringRule("steer-1", "node-b", "t"), SteeringRule("steer-2", "c", "t")]
        self.refuse: client.ApiException | None = None
        self.calls = 0

    def list(self) -> list[RuleInfo]:
        self.calls += 1
        if self.refuse is not None:
            raise self.refuse
        return list(self.clearing)

    def list_steering(self) -> list[SteeringRule]:
        self.calls += 1
        if self.refuse is not None:
            raise self.refuse
        return list(self.steering)

    def delete(self, name: str) -> None:
        self.clearing = [r for r in self.clearing if r.name != name]
        self.steering = [r for r in self.steering if r.name != name]

    def names(self) -> set[str]:
        return {r.name for r in self.clearing} | {r.name for r in self.steering}


def test_steering_turned_off_deletes_its_rules_and_leaves_clearings() -> None:
    rules = Rules()
    sweep = LeftoverRules(rules, clearing_on=True, steering_on=False)
    sweep.run_pass()
    assert rules.names() == {"clear-1"}
    assert sweep.deleted == 2


def test_both_off_delete_both_kinds_once_per_leadership() -> None:
    rules = Rules()
    sweep = LeftoverRules(rules, clearing_on=False, steering_on=False)
    sweep.run_pass()
    assert rules.names() == set()
    calls = rules.calls
    sweep.run_pass()  # done for this leadership: no more listing every second
    assert rules.calls == calls
    # Another leader (with steering on, say, during a rollout) made a rule meanwhile.
    rules.steering.append(SteeringRule("steer-3", "node-d", "t"))
    sweep.forget()
    sweep.run_pass()
    assert rules.names() == set()


def test_both_on_never_lists_or_deletes() -> None:
    rules = Rules()
    sweep = LeftoverRules(rules, clearing_on=True, steering_on=True)
    sweep.run_pass()
    sweep.forget()
    sweep.run_pass()
    assert rules.calls == 0 and len(rules.names()) == 3


def test_a_refused_sweep_is_tried_again_after_the_retry_interval() -> None:
    now = [100.0]
    rules = Rules()
    rules.refuse = client.ApiException(status=403, reason="Forbidden")
    sweep = LeftoverRules(
        rules, clearing_on=True, steering_on=False, retry_s=60.0, clock=lambda: now[0]
    )
    sweep.run_pass()
    assert len(rules.names()) == 3
    rules.refuse = None
    now[0] += 30.0
    sweep.run_pass()  # not yet
    assert len(rules.names()) == 3
    now[0] += 31.0
    sweep.run_pass()
    assert rules.names() == {"clear-1"}
