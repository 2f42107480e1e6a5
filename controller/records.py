"""What the controller keeps of each API object: the allocation model plus the few fields the
diagnostics read. Converting on arrival keeps the cache small (a pod's containers, a node's
status and a claim's managed fields are dropped) and parses each object once, not once per
explanation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from flexgpu.driver.allocation import (
    DeviceClass,
    Node,
    ResourceClaim,
    ResourceSlice,
    parse_claim,
    parse_device_class,
    parse_node,
    parse_slice,
)
from flexgpu.driver.allocation.model import NodeSelector, Taint, Toleration, parse_node_selector


def parse_time(text: Any) -> datetime | None:
    """A metav1.Time (``2025-01-01T00:00:00Z``), None when absent or malformed."""
    if not isinstance(text, str) or not text:
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)
    except ValueError:
        return None


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, Mapping) else {}


def object_key(obj: Mapping[str, Any]) -> str:
    """``namespace/name`` for namespaced objects, ``name`` otherwise."""
    meta = _meta(obj)
    name = str(meta.get("name", ""))
    namespace = meta.get("namespace")
    return f"{namespace}/{name}" if namespace else name


@dataclass(frozen=True)
class CachedClaim:
    """A ResourceClaim in the controller's cache (not the plugin's checkpoint ClaimRecord)."""

    model: ResourceClaim
    created: datetime | None
    device_classes: frozenset[str]
    # Where an allocated claim landed: the node selector the scheduler wrote (as text).
    allocation_nodes: tuple[str, ...] = ()
    reserved_for: tuple[str, ...] = ()

    @property
    def allocated(self) -> bool:
        return self.model.allocation is not None


@dataclass(frozen=True)
class NodeRecord:
    model: Node
    taints: tuple[Taint, ...] = ()
    unschedulable: bool = False


@dataclass(frozen=True)
class PodClaimRef:
    name: str  # the entry's name in pod.spec.resourceClaims
    claim: str | None  # the ResourceClaim's name; None while a template's claim is not made


@dataclass(frozen=True)
class PodRecord:
    namespace: str
    name: str
    uid: str
    created: datetime | None
    node_name: str
    phase: str
    claims: tuple[PodClaimRef, ...]
    node_selector: Mapping[str, str] = field(default_factory=dict)
    affinity: NodeSelector | None = None  # required node affinity
    tolerations: tuple[Toleration, ...] = ()
    deleting: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def claim_keys(self) -> list[str]:
        return [f"{self.namespace}/{ref.claim}" for ref in self.claims if ref.claim]


def claim_record(obj: Mapping[str, Any]) -> CachedClaim:
    model = parse_claim(obj)
    classes = {spec.device_class for request in model.requests for spec in request.alternatives()}
    status = obj.get("status") or {}
    allocation = status.get("allocation") or {}
    nodes: list[str] = []
    selector = parse_node_selector(allocation.get("nodeSelector"))
    for term in selector.terms if selector else ():
        for req in (*term.match_fields, *term.match_expressions):
            nodes.extend(req.values)
    reserved = tuple(
        str(ref.get("name", "")) for ref in status.get("reservedFor") or [] if isinstance(ref, dict)
    )
    return CachedClaim(
        model=model,
        created=parse_time(_meta(obj).get("creationTimestamp")),
        device_classes=frozenset(classes),
        allocation_nodes=tuple(nodes),
        reserved_for=reserved,
    )


def node_record(obj: Mapping[str, Any]) -> NodeRecord:
    spec = obj.get("spec") or {}
    taints = tuple(
        Taint(key=str(t.get("key", "")), value=str(t.get("value") or ""), effect=str(t["effect"]))
        for t in spec.get("taints") or []
        if isinstance(t, dict) and t.get("effect")
    )
    return NodeRecord(
        model=parse_node(obj), taints=taints, unschedulable=bool(spec.get("unschedulable"))
    )


def _tolerations(spec: Mapping[str, Any]) -> tuple[Toleration, ...]:
    return tuple(
        Toleration(
            key=str(t.get("key") or ""),
            operator=str(t.get("operator") or "Equal"),
            value=str(t.get("value") or ""),
            effect=str(t.get("effect") or ""),
        )
        for t in spec.get("tolerations") or []
        if isinstance(t, dict)
    )


def pod_record(obj: Mapping[str, Any]) -> PodRecord | None:
    """The pod, or None when it references no ResourceClaim (those are not kept)."""
    spec = obj.get("spec") or {}
    entries = [e for e in spec.get("resourceClaims") or [] if isinstance(e, dict)]
    if not entries:
        return None
    meta = _meta(obj)
    status = obj.get("status") or {}
    # Claims made from a template get a generated name, reported in the pod's status.
    generated = {
        str(s.get("name")): s.get("resourceClaimName")
        for s in status.get("resourceClaimStatuses") or []
        if isinstance(s, dict)
    }
    refs = []
    for entry in entries:
        name = str(entry.get("name", ""))
        claim = entry.get("resourceClaimName") or generated.get(name)
        refs.append(PodClaimRef(name=name, claim=str(claim) if claim else None))
    affinity = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    return PodRecord(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid", "")),
        created=parse_time(meta.get("creationTimestamp")),
        node_name=str(spec.get("nodeName") or ""),
        phase=str(status.get("phase") or "Pending"),
        claims=tuple(refs),
        node_selector={str(k): str(v) for k, v in (spec.get("nodeSelector") or {}).items()},
        affinity=parse_node_selector(affinity),
        tolerations=_tolerations(spec),
        deleting=bool(meta.get("deletionTimestamp")),
    )


def slice_record(obj: Mapping[str, Any]) -> ResourceSlice:
    return parse_slice(obj)


def class_record(obj: Mapping[str, Any]) -> DeviceClass:
    return parse_device_class(obj)


def policy_record(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """GpuNodePolicies stay JSON: the status work parses them with the model's own rules."""
    return obj
