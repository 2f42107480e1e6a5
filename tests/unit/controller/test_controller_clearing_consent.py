"""Consent to GPU clearing's evictions through a PodDisruptionBudget
(``controller.disruption_budgets``, ``driver.allocation.consolidation``): a pod a budget of
its namespace selects may move without the annotation; ``flexgpu.dev/movable: "false"``
refuses whatever budget selects it; a Job's pod never moves; two budgets (which the Eviction
API refuses) keep it in place; selectors follow policy/v1 (empty: every pod, null: none)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from controller_builders import NOW, load
from test_controller_clearing import Sink
from test_controller_clearing_eviction import (
    AFTER_S,
    EVICTED,
    WAITS,
    budgets_of,
    holder,
    objects,
    setup,
)

from flexgpu.controller.disruption_budgets import Budgets, label_selector, selects
from flexgpu.controller.events import EventTarget
from flexgpu.controller.records import pod_record
from flexgpu.driver.allocation.consolidation import Holder, HolderPod, consent, why_not_movable

SERVE = {"app": "serve", "tier": "gpu"}


def budget(name: str, selector: Any, ns: str = "ns") -> dict[str, Any]:
    spec: dict[str, Any] = {"maxUnavailable": 1}
    if selector is not ...:
        spec["selector"] = selector
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"namespace": ns, "name": name},
        "spec": spec,
    }


class Told(Sink):
    """Keeps the words of each Event as well."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[tuple[str, str]] = []

    def emit(
        self,
        target: EventTarget,
        reason: str,
        message: str,
        *,
        repeat: bool,
        event_type: str = "Warning",
    ) -> None:
        super().emit(target, reason, message, repeat=repeat, event_type=event_type)
        self.messages.append((reason, message))


# --- the decision ----------------------------------------------------------------------------


def _pod(
    movable: str | None, budgets: tuple[str, ...], controller: str = "ReplicaSet.apps"
) -> Holder:
    return Holder(
        "ns/a", HolderPod("ns", "a-pod", "u", movable, controller, False, budgets=budgets)
    )


def test_one_budget_that_selects_the_pod_is_consent() -> None:
    holder_ = _pod(None, ("serve",))
    assert why_not_movable(holder_) is None
    assert holder_.pod is not None
    assert consent(holder_.pod) == "PodDisruptionBudget ns/serve selects the pod"
    both = _pod("true", ("serve",))
    assert why_not_movable(both) is None
    assert both.pod is not None and "flexgpu.dev/movable" in (consent(both.pod) or "")


@pytest.mark.parametrize(
    ("movable", "budgets", "controller", "words"),
    [
        (
            "false",
            ("serve",),
            "ReplicaSet.apps",
            'carries flexgpu.dev/movable: "false": it refused, whatever PodDisruptionBudget',
        ),
        (
            None,
            ("a", "b"),
            "ReplicaSet.apps",
            "selected by more than one PodDisruptionBudget (a, b): the Eviction API refuses",
        ),
        (
            "true",
            ("a", "b"),
            "ReplicaSet.apps",
            "selected by more than one PodDisruptionBudget (a, b)",
        ),
        (None, ("serve",), "Job.batch", "belongs to a Job: a Job's pods are never evicted"),
        (
            "yes",
            ("serve",),
            "ReplicaSet.apps",
            'carries flexgpu.dev/movable: "yes": allowed are "true" (it may be evicted) and '
            '"false"',
        ),
        (None, ("serve",), "", "has no controller that makes it again"),
    ],
    ids=["opted-out", "two-budgets", "two-budgets-annotated", "job", "bad-value", "bare-pod"],
)
def test_a_budget_does_not_override_a_refusal_or_the_other_rules(
    movable: str | None, budgets: tuple[str, ...], controller: str, words: str
) -> None:
    reason = why_not_movable(_pod(movable, budgets, controller))
    assert reason is not None and words in reason, reason


# --- selectors, as policy/v1 reads them ------------------------------------------------------


@pytest.mark.parametrize(
    ("selector", "labels", "selected"),
    [
        ({}, {}, True),  # empty: every pod of the namespace
        ({}, SERVE, True),
        (None, SERVE, False),  # null: none
        ({"matchLabels": {"app": "serve"}}, SERVE, True),
        ({"matchLabels": {"app": "serve", "tier": "cpu"}}, SERVE, False),
        (
            {"matchExpressions": [{"key": "app", "operator": "In", "values": ["x", "serve"]}]},
            SERVE,
            True,
        ),
        (
            {"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["serve"]}]},
            SERVE,
            False,
        ),
        ({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["x"]}]}, {}, True),
        ({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, SERVE, True),
        ({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}, SERVE, False),
        (
            {
                "matchLabels": {"app": "serve"},
                "matchExpressions": [{"key": "tier", "operator": "In", "values": ["cpu"]}],
            },
            SERVE,
            False,
        ),
    ],
)
def test_a_selector_selects_as_policy_v1_reads_it(
    selector: Any, labels: dict[str, str], selected: bool
) -> None:
    assert selects(label_selector(selector, "spec.selector"), labels) is selected


@pytest.mark.parametrize(
    ("selector", "words"),
    [
        (
            {"matchExpressions": [{"key": "app", "operator": "Equals", "values": ["x"]}]},
            "spec.selector.matchExpressions[0].operator: 'Equals': allowed are In, NotIn, "
            "Exists, DoesNotExist",
        ),
        (
            {"matchExpressions": [{"key": "app", "operator": "In"}]},
            "spec.selector.matchExpressions[0].values: [] with operator In: allowed is a "
            "non-empty list with In and NotIn",
        ),
        (
            {"matchExpressions": [{"key": "app", "operator": "Exists", "values": ["x"]}]},
            "values: ['x'] with operator Exists",
        ),
        ({"matchLabels": {"app": 1}}, "spec.selector.matchLabels: {'app': 1}: allowed is a map"),
        ("app=serve", "spec.selector: 'app=serve' is not a label selector"),
    ],
)
def test_a_bad_selector_names_the_field_the_value_and_what_is_allowed(
    selector: Any, words: str
) -> None:
    with pytest.raises(ValueError) as err:
        label_selector(selector, "spec.selector")
    assert words in str(err.value)


def test_the_store_follows_the_watch_and_leaves_a_bad_budget_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    budgets = Budgets()
    assert not budgets.synced()
    bad = budget("bad", {"matchExpressions": [{"key": "app", "operator": "Near"}]})
    with caplog.at_level(logging.WARNING):
        budgets.replace(
            "budgets",
            [
                budget("serve", {"matchLabels": {"app": "serve"}}),
                budget("all", {}),
                budget("none", ...),
                budget("elsewhere", {}, ns="other"),
                bad,
            ],
        )
    assert budgets.synced()
    assert "PodDisruptionBudget ns/bad: spec.selector.matchExpressions[0].operator" in caplog.text
    assert budgets.selecting("ns", SERVE) == ("all", "serve")
    assert budgets.selecting("ns", {}) == ("all",)
    budgets.apply("budgets", "DELETED", budget("all", {}))
    budgets.apply("budgets", "MODIFIED", budget("serve", {"matchLabels": {"app": "other"}}))
    assert budgets.selecting("ns", SERVE) == ()
    budgets.apply("budgets", "ADDED", budget("serve2", {"matchLabels": {"tier": "gpu"}}))
    assert budgets.selecting("ns", SERVE) == ("serve2",)


def test_a_pods_labels_and_its_annotation_as_written_are_read() -> None:
    _, running = holder("a", "gpu-0-mig-1g10gb-0", movable="False", labels=SERVE)
    record = pod_record(running)
    assert record is not None
    assert (record.movable, dict(record.labels)) == ("False", SERVE)
    _, plain = holder("a", "gpu-0-mig-1g10gb-0", movable=False)
    assert (pod_record(plain) or record).movable is None


# --- the leader's passes ---------------------------------------------------------------------


def _past_the_bound(budgets: Budgets, **kwargs: Any) -> tuple[list[str], Told]:
    told = Told()
    clearing, evictor, _, clock, state = setup(budgets=budgets, sink=told)
    world_ = objects(holder("a", "gpu-0-mig-1g10gb-0", **kwargs))
    clearing.run_pass(load(state, **world_), NOW)
    clock.now += AFTER_S + 1
    clearing.run_pass(load(state, **world_), NOW)
    return evictor.calls, told


def test_a_deployments_pod_a_budget_selects_is_evicted_and_the_event_names_the_budget() -> None:
    serve = budgets_of(budget("serve", {"matchLabels": {"app": "serve"}}))
    calls, told = _past_the_bound(serve, movable=False, labels=SERVE)
    assert calls == ["ns/a-pod"]
    evicted = [m for r, m in told.messages if r == EVICTED]
    assert evicted and all("PodDisruptionBudget ns/serve selects the pod" in m for m in evicted)


@pytest.mark.parametrize(
    ("listed", "kwargs", "words"),
    [
        ([budget("serve", {"matchLabels": {"app": "serve"}})], {"movable": "false"}, "refused"),
        ([budget("serve", {}, ns="other")], {"movable": False}, "did not consent"),
        ([budget("serve", ...)], {"movable": False}, "did not consent"),
        ([budget("serve", {})], {"movable": False, "owner": "Job"}, "belongs to a Job"),
    ],
    ids=["opted-out", "budget-of-another-namespace", "null-selector", "job"],
)
def test_a_budget_that_gives_no_consent_leaves_the_pod_and_the_claim_is_told_why(
    listed: list[dict[str, Any]], kwargs: dict[str, Any], words: str
) -> None:
    calls, told = _past_the_bound(budgets_of(*listed), labels=SERVE, **kwargs)
    assert calls == []
    waits = [m for r, m in told.messages if r == WAITS]
    assert len(waits) == 1 and words in waits[0], waits


def test_nothing_is_decided_before_the_budgets_are_listed() -> None:
    budgets = Budgets()
    clearing, evictor, sink, clock, state = setup(budgets=budgets)
    world_ = objects(holder("a", "gpu-0-mig-1g10gb-0", movable=False, labels=SERVE))
    clearing.run_pass(load(state, **world_), NOW)
    clock.now += AFTER_S + 1
    clearing.run_pass(load(state, **world_), NOW)
    # Not yet listed: the pod would be taken for one that did not consent.
    assert evictor.calls == [] and not [e for e in sink.events if e[2] == WAITS]
    budgets.replace("budgets", [budget("serve", {"matchLabels": {"app": "serve"}})])
    clock.now += 1
    clearing.run_pass(load(state, **world_), NOW)
    assert evictor.calls == ["ns/a-pod"]
