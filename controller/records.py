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

from flexgpu.controller.extended_resources import extended_resources
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
from flexgpu.driver.allocation.consolidation import MOVABLE_ANNOTATION
from flexgpu.driver.allocation.model import NodeSelector, Taint, Toleration, parse_node_selector
from flexgpu.driver.claim_consumers import consumers
from flexgpu.driver.names import DRIVER_NAME


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
class DeviceBinding:
    """One of flexgpu's allocated devices that has binding conditions (KEP-5007): which of
    them are not True yet in the claim's ``status.devices``, and which failure conditions are."""

    pool: str  # flexgpu names a node's pool after the node
    device: str
    share_id: str  # "" for a device allocated whole
    pending: tuple[str, ...]  # binding conditions not True yet
    failed: tuple[str, ...] = ()  # binding failure conditions that are True

    @property
    def name(self) -> str:
        return f"{self.pool}/{self.device}"


@dataclass(frozen=True)
class CachedClaim:
    """A ResourceClaim in the controller's cache (not the plugin's checkpoint ClaimRecord)."""

    model: ResourceClaim
    created: datetime | None
    device_classes: frozenset[str]
    # Where an allocated claim landed: the node selector the scheduler wrote (as text).
    allocation_nodes: tuple[str, ...] = ()
    # status.reservedFor as people read it: pod names, a gang's PodGroup as
    # "podgroups.scheduling.k8s.io/<name>" (driver.claim_consumers).
    reserved_for: tuple[str, ...] = ()
    # status.allocation.allocationTimestamp; None when the server did not write it.
    allocated_at: datetime | None = None
    # flexgpu's allocated devices that carry binding conditions, with what they wait for.
    bindings: tuple[DeviceBinding, ...] = ()
    # Not an API object: the claim the scheduler will make for a pod's extended resources
    # (controller.extended_resources), as (resource name, count).
    extended_resources: tuple[tuple[str, int], ...] = ()
    # The pod the claim was generated for (a ResourceClaimTemplate's claim is controlled by
    # its pod and deleted with it), as (name, uid); None for a claim made by name.
    owner_pod: tuple[str, str] | None = None

    @property
    def allocated(self) -> bool:
        return self.model.allocation is not None

    @property
    def binding_failed(self) -> bool:
        """A failure condition is True: the scheduler sends the claim back, it waits no more."""
        return any(b.failed for b in self.bindings)

    @property
    def binding_pending(self) -> tuple[DeviceBinding, ...]:
        """The devices whose binding conditions the scheduler still waits for (none once a
        failure condition is set: the pod goes back to be scheduled again)."""
        if not self.allocated or self.binding_failed:
            return ()
        return tuple(b for b in self.bindings if b.pending)


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
    # Extended resources the pod asks for (name -> count, as the scheduler sums them), e.g.
    # {"nvidia.com/gpu": 2}; a DeviceClass may serve them (DRAExtendedResource).
    extended_resources: Mapping[str, int] = field(default_factory=dict)
    # status.extendedResourceClaimStatus was written: the scheduler made the pod's claim.
    extended_claim_made: bool = False
    # spec.schedulingGroup.podGroupName: a gang member waits for its group, not only its GPUs.
    pod_group: str = ""
    # metadata.annotations["flexgpu.dev/movable"] ("true": its owner lets GPU clearing evict
    # it; "false": it does not, whatever budget selects it); None when absent
    # (driver.allocation.consolidation).
    movable: str | None = None
    # metadata.labels: which PodDisruptionBudgets select it (controller.disruption_budgets).
    labels: Mapping[str, str] = field(default_factory=dict)
    # The controlling ownerReference as "Kind.group" ("ReplicaSet.apps", "Job.batch",
    # "ReplicationController" for the core group); "" for a pod no controller owns.
    controller: str = ""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def claim_keys(self) -> list[str]:
        return [f"{self.namespace}/{ref.claim}" for ref in self.claims if ref.claim]


def _strings(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        return ()
    return tuple(s for s in value if isinstance(s, str) and s)


def _true_conditions(status: Mapping[str, Any]) -> dict[tuple[str, str, str], set[str]]:
    """(pool, device, share ID) -> the condition types True in the claim's status.devices
    entries of flexgpu's devices; entries of any other shape are skipped."""
    true: dict[tuple[str, str, str], set[str]] = {}
    entries = status.get("devices")
    for entry in entries if isinstance(entries, list) else ():
        if not isinstance(entry, Mapping) or entry.get("driver") != DRIVER_NAME:
            continue
        key = (str(entry.get("pool") or ""), str(entry.get("device") or ""), _share(entry))
        conditions = entry.get("conditions")
        for condition in conditions if isinstance(conditions, list) else ():
            if isinstance(condition, Mapping) and condition.get("status") == "True":
                true.setdefault(key, set()).add(str(condition.get("type") or ""))
    return true


def _share(entry: Mapping[str, Any]) -> str:
    share = entry.get("shareID")
    return str(share) if share else ""


def device_bindings(status: Any) -> tuple[DeviceBinding, ...]:
    """flexgpu's allocated devices with binding conditions, read from a claim's status. Never
    raises: what does not have the API's shape is left out."""
    if not isinstance(status, Mapping):
        return ()
    allocation = status.get("allocation")
    devices = allocation.get("devices") if isinstance(allocation, Mapping) else None
    results = devices.get("results") if isinstance(devices, Mapping) else None
    if not isinstance(results, list):
        return ()
    true = _true_conditions(status)
    bindings = []
    for result in results:
        if not isinstance(result, Mapping) or result.get("driver") != DRIVER_NAME:
            continue
        conditions = _strings(result.get("bindingConditions"))
        if not conditions:
            continue
        key = (str(result.get("pool") or ""), str(result.get("device") or ""), _share(result))
        met = true.get(key, set())
        bindings.append(
            DeviceBinding(
                pool=key[0],
                device=key[1],
                share_id=key[2],
                pending=tuple(c for c in conditions if c not in met),
                failed=tuple(
                    c for c in _strings(result.get("bindingFailureConditions")) if c in met
                ),
            )
        )
    return tuple(bindings)


def controller_owner(meta: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """The controlling ownerReference as ("Kind.group", name, uid); None when there is none."""
    for ref in meta.get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            group = str(ref.get("apiVersion") or "").rpartition("/")[0]
            kind = str(ref.get("kind") or "")
            return (
                f"{kind}.{group}" if group else kind,
                str(ref.get("name") or ""),
                str(ref.get("uid") or ""),
            )
    return None


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
    reserved = tuple(c.label for c in consumers(status))
    owner = controller_owner(_meta(obj))
    return CachedClaim(
        model=model,
        created=parse_time(_meta(obj).get("creationTimestamp")),
        device_classes=frozenset(classes),
        allocation_nodes=tuple(nodes),
        reserved_for=reserved,
        allocated_at=parse_time(
            allocation.get("allocationTimestamp") if isinstance(allocation, Mapping) else None
        ),
        bindings=device_bindings(status),
        owner_pod=(owner[1], owner[2]) if owner is not None and owner[0] == "Pod" else None,
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


def _movable(value: object) -> str | None:
    return None if value is None else str(value)


def pod_record(obj: Mapping[str, Any]) -> PodRecord | None:
    """The pod, or None when it references no ResourceClaim and asks for no extended resource
    (those are not kept)."""
    spec = obj.get("spec") or {}
    entries = [e for e in spec.get("resourceClaims") or [] if isinstance(e, dict)]
    extended = extended_resources(spec)
    if not entries and not extended:
        return None
    meta = _meta(obj)
    status = obj.get("status") or {}
    owner = controller_owner(meta)
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
        extended_resources=extended,
        extended_claim_made=bool(status.get("extendedResourceClaimStatus")),
        pod_group=str((spec.get("schedulingGroup") or {}).get("podGroupName") or ""),
        movable=_movable((meta.get("annotations") or {}).get(MOVABLE_ANNOTATION)),
        labels={str(k): str(v) for k, v in (meta.get("labels") or {}).items()},
        controller=owner[0] if owner is not None else "",
    )


def slice_record(obj: Mapping[str, Any]) -> ResourceSlice:
    return parse_slice(obj)


def class_record(obj: Mapping[str, Any]) -> DeviceClass:
    return parse_device_class(obj)


def policy_record(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    """GpuNodePolicies stay JSON: the status work parses them with the model's own rules."""
    return obj
