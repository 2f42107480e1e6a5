"""The PodDisruptionBudgets (policy/v1) that GPU clearing reads as consent to evict a pod.

A budget is its owner's statement of how many of the pods it selects may be disrupted at
once; the Eviction API holds every eviction to it (HTTP 429 while it has no room). So a pod
that a budget of its namespace selects may be evicted by GPU clearing without the
``flexgpu.dev/movable`` annotation (``driver.allocation.consolidation`` decides; the
annotation's "false" still refuses). Kept by a watch (``controller.reflector``) only where
eviction is on, so the controller needs no access to budgets otherwise.

Selectors follow policy/v1: an empty selector selects every pod of the budget's namespace, a
null one selects none. A budget whose selector the API server would not accept is logged and
left out: it consents to nothing, the safe side.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from kubernetes import client

from flexgpu.controller.cluster_state import Kind
from flexgpu.controller.records import object_key

log = logging.getLogger(__name__)

OPERATORS: Final = ("In", "NotIn", "Exists", "DoesNotExist")
WITH_VALUES: Final = ("In", "NotIn")


@dataclass(frozen=True)
class Budget:
    namespace: str
    name: str
    selector: client.V1LabelSelector | None  # None: selects no pod


def label_selector(raw: object, path: str) -> client.V1LabelSelector | None:
    """``raw`` (a metav1.LabelSelector as JSON) as the client's model; ValueError naming the
    field, the value and what is allowed when the API server would not accept it."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path}: {raw!r} is not a label selector (an object)")
    labels = raw.get("matchLabels") or {}
    if not isinstance(labels, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    ):
        raise ValueError(f"{path}.matchLabels: {labels!r}: allowed is a map of strings to strings")
    requirements = []
    for i, entry in enumerate(raw.get("matchExpressions") or []):
        where = f"{path}.matchExpressions[{i}]"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("key"), str):
            raise ValueError(f"{where}: {entry!r}: allowed is an object with a string key")
        operator, values = entry.get("operator"), entry.get("values") or []
        if operator not in OPERATORS:
            raise ValueError(f"{where}.operator: {operator!r}: allowed are {', '.join(OPERATORS)}")
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ValueError(f"{where}.values: {values!r}: allowed is a list of strings")
        if (operator in WITH_VALUES) != bool(values):
            raise ValueError(
                f"{where}.values: {values!r} with operator {operator}: allowed is a non-empty "
                "list with In and NotIn, none with Exists and DoesNotExist"
            )
        requirements.append(
            client.V1LabelSelectorRequirement(
                key=entry["key"], operator=operator, values=list(values) or None
            )
        )
    return client.V1LabelSelector(
        match_labels=dict(labels) or None, match_expressions=requirements or None
    )


def selects(selector: client.V1LabelSelector | None, labels: Mapping[str, str]) -> bool:
    """Whether ``selector`` selects a pod with ``labels``, as policy/v1 reads a budget's."""
    if selector is None:
        return False
    for key, value in (selector.match_labels or {}).items():
        if labels.get(key) != value:
            return False
    for requirement in selector.match_expressions or ():
        present = requirement.key in labels
        if requirement.operator == "Exists":
            matched = present
        elif requirement.operator == "DoesNotExist":
            matched = not present
        else:
            inside = present and labels[requirement.key] in (requirement.values or ())
            matched = inside if requirement.operator == "In" else not inside
        if not matched:
            return False
    return True


def budget_record(obj: Mapping[str, Any]) -> Budget:
    meta = obj.get("metadata") or {}
    namespace, name = str(meta.get("namespace", "")), str(meta.get("name", ""))
    spec = obj.get("spec") or {}
    path = f"PodDisruptionBudget {namespace}/{name}: spec.selector"
    return Budget(namespace, name, label_selector(spec.get("selector"), path))


class Budgets:
    """Every namespace's budgets, kept by a reflector (``replace`` and ``apply``), read by the
    leader's eviction passes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._budgets: dict[str, Budget] = {}
        self._synced = False

    def _record(self, obj: Mapping[str, Any]) -> Budget | None:
        try:
            return budget_record(obj)
        except ValueError as err:
            log.warning("ignoring %s (it consents to no eviction)", err)
            return None

    def replace(self, kind: Kind, objects: Iterable[Mapping[str, Any]]) -> None:
        fresh = {object_key(o): b for o in objects if (b := self._record(o)) is not None}
        with self._lock:
            self._budgets = fresh
            self._synced = True

    def apply(self, kind: Kind, event: str, obj: Mapping[str, Any]) -> None:
        key = object_key(obj)
        budget = None if event == "DELETED" else self._record(obj)
        with self._lock:
            if budget is None:
                self._budgets.pop(key, None)
            else:
                self._budgets[key] = budget

    def synced(self) -> bool:
        with self._lock:
            return self._synced

    def selecting(self, namespace: str, labels: Mapping[str, str]) -> tuple[str, ...]:
        """The names of the budgets of ``namespace`` that select a pod with ``labels``."""
        with self._lock:
            budgets = list(self._budgets.values())
        return tuple(
            sorted(
                b.name for b in budgets if b.namespace == namespace and selects(b.selector, labels)
            )
        )
