"""Which nodes a pending pod may land on, and in words why the others are out.

Follows the scheduler's node filters that do not depend on what else runs on the node: the
pod's ``nodeSelector``, required node affinity (terms ORed, requirements ANDed, ``matchFields``
on ``metadata.name``), ``spec.unschedulable`` (the scheduler's own
``node.kubernetes.io/unschedulable:NoSchedule`` taint) and node taints with effect NoSchedule
or NoExecute against the pod's tolerations. CPU, memory and pod-count fit are left out on
purpose: they change by the second and are the scheduler's own message to give.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from flexgpu.controller.records import NodeRecord, PodRecord
from flexgpu.driver.allocation.model import Taint
from flexgpu.driver.allocation.nodes import selector_matches

UNSCHEDULABLE_TAINT = Taint("node.kubernetes.io/unschedulable", "", "NoSchedule")
_BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")


@dataclass(frozen=True)
class NodeFit:
    usable: tuple[str, ...]
    # node name -> why the pod cannot use it, e.g. "nodeSelector zone=a does not match"
    excluded: Mapping[str, str] = field(default_factory=dict)


def show_taint(taint: Taint) -> str:
    value = f"={taint.value}" if taint.value else ""
    return f"{taint.key}{value}:{taint.effect}"


def _selector_mismatch(pod: PodRecord, labels: Mapping[str, str]) -> str:
    wrong = [f"{k}={v}" for k, v in sorted(pod.node_selector.items()) if labels.get(k) != v]
    return f"nodeSelector {', '.join(wrong)} does not match" if wrong else ""


def exclusion(pod: PodRecord, node: NodeRecord) -> str:
    """Why ``pod`` cannot use ``node``; empty when it can."""
    mismatch = _selector_mismatch(pod, node.model.labels)
    if mismatch:
        return mismatch
    if pod.affinity is not None and not selector_matches(pod.affinity, node.model):
        return "required node affinity does not match"
    taints = [*node.taints, UNSCHEDULABLE_TAINT] if node.unschedulable else list(node.taints)
    untolerated = [
        t
        for t in taints
        if t.effect in _BLOCKING_EFFECTS and not any(x.tolerates(t) for x in pod.tolerations)
    ]
    if untolerated:
        shown = ", ".join(show_taint(t) for t in untolerated[:2])
        return f"taint {shown} not tolerated"
    return ""


def node_fit(pod: PodRecord, nodes: Iterable[NodeRecord]) -> NodeFit:
    usable: list[str] = []
    excluded: dict[str, str] = {}
    for node in sorted(nodes, key=lambda n: n.model.name):
        why = exclusion(pod, node)
        if why:
            excluded[node.model.name] = why
        else:
            usable.append(node.model.name)
    return NodeFit(tuple(usable), excluded)
