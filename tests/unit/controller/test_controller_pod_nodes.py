"""Which nodes a pending pod may use: nodeSelector, required affinity, taints, cordons."""

from __future__ import annotations

from controller_builders import node, pod

from flexgpu.controller.pod_nodes import node_fit
from flexgpu.controller.records import node_record, pod_record

NO_SCHEDULE = {"key": "gpu", "value": "busy", "effect": "NoSchedule"}


def _fit(pod_body: dict, *nodes: dict) -> tuple[tuple[str, ...], dict[str, str]]:
    record = pod_record(pod_body)
    assert record is not None
    fit = node_fit(record, [node_record(n) for n in nodes])
    return fit.usable, dict(fit.excluded)


def test_node_selector_names_the_mismatching_labels() -> None:
    usable, excluded = _fit(
        pod("p", "c", node_selector={"zone": "a", "tier": "gpu"}),
        node("n1", {"zone": "a", "tier": "gpu"}),
        node("n2", {"zone": "b", "tier": "gpu"}),
    )
    assert usable == ("n1",)
    assert excluded == {"n2": "nodeSelector zone=a does not match"}


def test_required_affinity_terms_are_ored_and_match_fields_on_the_name() -> None:
    terms = [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100", "h200"]}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n3"]}]},
    ]
    usable, excluded = _fit(
        pod("p", "c", affinity=terms),
        node("n1", {"gpu": "h100"}),
        node("n2", {"gpu": "l4"}),
        node("n3", {"gpu": "l4"}),
    )
    assert usable == ("n1", "n3")
    assert excluded == {"n2": "required node affinity does not match"}


def test_taints_need_tolerations_but_prefer_no_schedule_does_not_count() -> None:
    soft = {"key": "soft", "value": "", "effect": "PreferNoSchedule"}
    nodes = (node("n1", taints=[NO_SCHEDULE]), node("n2", taints=[soft]))
    usable, excluded = _fit(pod("p", "c"), *nodes)
    assert usable == ("n2",)
    assert excluded == {"n1": "taint gpu=busy:NoSchedule not tolerated"}
    tolerant = pod("p", "c", tolerations=[{"key": "gpu", "operator": "Exists"}])
    assert _fit(tolerant, *nodes)[0] == ("n1", "n2")
    wrong_value = pod("p", "c", tolerations=[{"key": "gpu", "value": "idle"}])
    assert _fit(wrong_value, *nodes)[0] == ("n2",)


def test_cordoned_node_is_out_unless_tolerated() -> None:
    cordoned = node("n1", unschedulable=True)
    usable, excluded = _fit(pod("p", "c"), cordoned)
    assert usable == () and "node.kubernetes.io/unschedulable:NoSchedule" in excluded["n1"]
    anything = pod("p", "c", tolerations=[{"operator": "Exists"}])
    assert _fit(anything, cordoned)[0] == ("n1",)
