"""The controller's in-memory copy of the cluster: slices, device classes, claims, nodes, pods
that use claims and GpuNodePolicies, kept current by the watches (``controller.reflector``) and
read as consistent snapshots by the diagnostics, metrics and status work.

Objects are converted to records on arrival (``controller.records``); an object its converter
rejects is logged and left out rather than stopping the watch, since one malformed object must
not blind the controller to the rest of the cluster.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Final, Literal, Protocol

from flexgpu.controller import records
from flexgpu.controller.records import CachedClaim, NodeRecord, PodRecord
from flexgpu.driver.allocation import DeviceClass, Node, ParseError, ResourceClaim, ResourceSlice
from flexgpu.driver.allocation.pools import SliceIndex

log = logging.getLogger(__name__)

# What the controller watches. KINDS: what this cache holds; PodDisruptionBudgets ("budgets")
# are kept apart, and only where GPU clearing may evict (controller.disruption_budgets).
Kind = Literal["slices", "classes", "claims", "nodes", "pods", "policies", "budgets"]
KINDS: Final[tuple[Kind, ...]] = ("slices", "classes", "claims", "nodes", "pods", "policies")
# Kinds the diagnostics cannot work without; policies are optional (the CRD may be absent).
REQUIRED: Final[tuple[Kind, ...]] = ("slices", "classes", "claims", "nodes", "pods")

_CONVERTERS: Final[dict[Kind, Callable[[Mapping[str, Any]], Any]]] = {
    "slices": records.slice_record,
    "classes": records.class_record,
    "claims": records.claim_record,
    "nodes": records.node_record,
    "pods": records.pod_record,
    "policies": records.policy_record,
}


@dataclass(frozen=True)
class Snapshot:
    """One consistent view; ``revision`` grows with every change that can alter allocation."""

    slices: Mapping[str, ResourceSlice]
    classes: Mapping[str, DeviceClass]
    claims: Mapping[str, CachedClaim]
    nodes: Mapping[str, NodeRecord]
    pods: Mapping[str, PodRecord]
    policies: Mapping[str, Mapping[str, Any]]
    revision: int
    # Grows only when a slice changes: results cached per device (CEL selectors) stay valid
    # while it stays the same, whatever claims and pods do.
    slices_revision: int = 0

    # Views every explanation over this snapshot needs, built once per snapshot rather than
    # once per claim (a leader pass explains thousands).
    @cached_property
    def slice_list(self) -> list[ResourceSlice]:
        return list(self.slices.values())

    @cached_property
    def slice_index(self) -> SliceIndex:
        return SliceIndex(self.slice_list)

    @cached_property
    def claim_models(self) -> list[ResourceClaim]:
        return [c.model for c in self.claims.values()]

    @cached_property
    def node_models(self) -> list[Node]:
        return [n.model for n in self.nodes.values()]


class RawListener(Protocol):
    """Told every object of one kind as it arrives, before conversion (the claim labeller
    needs metadata the records leave out)."""

    def listed(self, objects: Iterable[Mapping[str, Any]]) -> None: ...

    def changed(self, event: str, obj: Mapping[str, Any]) -> None: ...


class ClusterState:
    def __init__(self, listeners: Mapping[Kind, RawListener] | None = None) -> None:
        self._listeners = dict(listeners or {})
        self._lock = threading.Lock()
        self._objects: dict[Kind, dict[str, Any]] = {kind: {} for kind in KINDS}
        self._synced: set[Kind] = set()
        self._revision = 0
        self._slices_revision = 0

    def _convert(self, kind: Kind, obj: Mapping[str, Any]) -> Any:
        try:
            return _CONVERTERS[kind](obj)
        except (ParseError, ValueError, TypeError, KeyError) as err:
            log.warning("ignoring %s %s: %s", kind, records.object_key(obj), err)
            return None

    def replace(self, kind: Kind, objects: Iterable[Mapping[str, Any]]) -> None:
        """A full listing: what is not in it is gone (deletions missed between watches)."""
        listener = self._listeners.get(kind)
        if listener is not None:
            objects = list(objects)
            listener.listed(objects)
        fresh: dict[str, Any] = {}
        for obj in objects:
            record = self._convert(kind, obj)
            if record is not None:
                fresh[records.object_key(obj)] = record
        with self._lock:
            self._objects[kind] = fresh
            self._synced.add(kind)
            self._bump(kind)

    def apply(self, kind: Kind, event: str, obj: Mapping[str, Any]) -> None:
        """One watch event: ADDED, MODIFIED or DELETED."""
        listener = self._listeners.get(kind)
        if listener is not None:
            listener.changed(event, obj)
        key = records.object_key(obj)
        record = None if event == "DELETED" else self._convert(kind, obj)
        with self._lock:
            if record is None:
                if self._objects[kind].pop(key, None) is None:
                    return
            else:
                self._objects[kind][key] = record
            self._bump(kind)

    def _bump(self, kind: Kind) -> None:
        self._revision += 1
        if kind == "slices":
            self._slices_revision += 1

    def synced(self, kinds: Iterable[Kind] = REQUIRED) -> bool:
        with self._lock:
            return all(kind in self._synced for kind in kinds)

    def snapshot(self) -> Snapshot:
        with self._lock:
            o = self._objects
            return Snapshot(
                slices=dict(o["slices"]),
                classes=dict(o["classes"]),
                claims=dict(o["claims"]),
                nodes=dict(o["nodes"]),
                pods=dict(o["pods"]),
                policies=dict(o["policies"]),
                revision=self._revision,
                slices_revision=self._slices_revision,
            )

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {kind: len(objects) for kind, objects in self._objects.items()}
