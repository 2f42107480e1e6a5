"""The allocation inputs, parsed from the API's JSON (``resource.k8s.io/v1`` and core ``v1``).

Parsers accept what ``ApiClient().sanitize_for_serialization(obj)`` or a raw GET returns and
keep only what allocation needs. Quantities are exact (``Fraction``) so that capacity sums and
comparisons never round. Parsing is lenient about absent optional fields, strict about types.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Literal

from flexgpu.driver.claim_results import AllocatedDevice, parse_allocated_device
from flexgpu.driver.quantity import parse_quantity

AttributeKind = Literal["int", "bool", "string", "version", "ints", "bools", "strings", "versions"]
ATTRIBUTE_KINDS: tuple[AttributeKind, ...] = (
    "int",
    "bool",
    "string",
    "version",
    "ints",
    "bools",
    "strings",
    "versions",
)

# Results of one claim may hold at most this many devices (resource.k8s.io/v1 limit).
ALLOCATION_RESULTS_MAX_SIZE = 32


def quantity(text: Any) -> Fraction:
    """A quantity field's exact value; the API serialises quantities as strings (or numbers)."""
    return parse_quantity(str(text)).value


@dataclass(frozen=True)
class AttributeValue:
    kind: AttributeKind
    value: Any  # int | bool | str, or a tuple of those for the list kinds

    @property
    def is_list(self) -> bool:
        return self.kind.endswith("s")


@dataclass(frozen=True)
class RequestPolicy:
    default: Fraction | None = None
    valid_values: tuple[Fraction, ...] | None = None
    range_min: Fraction | None = None
    range_max: Fraction | None = None
    range_step: Fraction | None = None
    has_range: bool = False


@dataclass(frozen=True)
class DeviceCapacity:
    value: Fraction
    policy: RequestPolicy | None = None


@dataclass(frozen=True)
class Taint:
    key: str
    value: str
    effect: str


@dataclass(frozen=True)
class Toleration:
    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""

    def tolerates(self, taint: Taint) -> bool:
        if self.effect and self.effect != taint.effect:
            return False
        if self.key and self.key != taint.key:
            return False
        if self.operator in ("", "Equal"):
            return self.value == taint.value
        return self.operator == "Exists"


@dataclass(frozen=True)
class NodeSelectorRequirement:
    key: str
    operator: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class NodeSelectorTerm:
    match_expressions: tuple[NodeSelectorRequirement, ...] = ()
    match_fields: tuple[NodeSelectorRequirement, ...] = ()


@dataclass(frozen=True)
class NodeSelector:
    terms: tuple[NodeSelectorTerm, ...]


@dataclass(frozen=True)
class Device:
    name: str
    attributes: Mapping[str, AttributeValue] = field(default_factory=dict)
    capacity: Mapping[str, DeviceCapacity] = field(default_factory=dict)
    # counter set name -> counter name -> amount
    consumes_counters: tuple[tuple[str, Mapping[str, Fraction]], ...] = ()
    taints: tuple[Taint, ...] = ()
    allow_multiple_allocations: bool = False
    binding_conditions: tuple[str, ...] = ()
    # Only meaningful in a slice with perDeviceNodeSelection.
    node_name: str | None = None
    node_selector: NodeSelector | None = None
    all_nodes: bool = False


@dataclass(frozen=True)
class ResourceSlice:
    name: str
    driver: str
    pool: str
    generation: int
    resource_slice_count: int
    devices: tuple[Device, ...] = ()
    # counter set name -> counter name -> amount
    shared_counters: tuple[tuple[str, Mapping[str, Fraction]], ...] = ()
    node_name: str | None = None
    node_selector: NodeSelector | None = None
    all_nodes: bool = False
    per_device_node_selection: bool = False


@dataclass(frozen=True)
class DeviceClass:
    name: str
    selectors: tuple[str, ...] = ()
    # spec.extendedResourceName (DRAExtendedResource): pods asking that extended resource in
    # their containers' resources are served from this class.
    extended_resource_name: str = ""


@dataclass(frozen=True)
class RequestSpec:
    """What an ``exactly`` request and a ``firstAvailable`` subrequest have in common."""

    name: str
    device_class: str
    selectors: tuple[str, ...] = ()
    mode: Literal["ExactCount", "All"] = "ExactCount"
    count: int = 1
    admin_access: bool = False
    tolerations: tuple[Toleration, ...] = ()
    # None when the request says nothing about capacity.
    capacity_requests: Mapping[str, Fraction] | None = None


@dataclass(frozen=True)
class DeviceRequest:
    name: str
    exactly: RequestSpec | None = None
    first_available: tuple[RequestSpec, ...] = ()

    def alternatives(self) -> tuple[RequestSpec, ...]:
        return self.first_available if self.exactly is None else (self.exactly,)


@dataclass(frozen=True)
class Constraint:
    kind: Literal["matchAttribute", "distinctAttribute"]
    attribute: str
    requests: tuple[str, ...] = ()


@dataclass(frozen=True)
class ResourceClaim:
    name: str
    namespace: str = ""
    uid: str = ""
    requests: tuple[DeviceRequest, ...] = ()
    constraints: tuple[Constraint, ...] = ()
    allocation: tuple[AllocatedDevice, ...] | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name


@dataclass(frozen=True)
class Node:
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)


class ParseError(ValueError):
    """An object does not have the shape of the API type it claims to be."""


# --- parsing ---------------------------------------------------------------------------------


def _dict(data: Any, what: str) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ParseError(f"{what}: expected an object, got {type(data).__name__}")
    return data


def _list(data: Any, what: str) -> list[Any]:
    if data is None:
        return []
    if not isinstance(data, list):
        raise ParseError(f"{what}: expected a list, got {type(data).__name__}")
    return data


def parse_attribute(data: Any, what: str) -> AttributeValue:
    body = _dict(data, what)
    for kind in ATTRIBUTE_KINDS:
        if body.get(kind) is not None:
            raw = body[kind]
            return AttributeValue(kind, tuple(raw) if isinstance(raw, list) else raw)
    raise ParseError(f"{what}: no value of a known type ({', '.join(ATTRIBUTE_KINDS)})")


def _policy(data: Any, what: str) -> RequestPolicy | None:
    if data is None:
        return None
    body = _dict(data, what)
    default = body.get("default")
    values = body.get("validValues")
    valid_range = body.get("validRange")
    rng = _dict(valid_range, f"{what}.validRange")
    return RequestPolicy(
        default=None if default is None else quantity(default),
        valid_values=None if values is None else tuple(quantity(v) for v in values),
        range_min=None if rng.get("min") is None else quantity(rng["min"]),
        range_max=None if rng.get("max") is None else quantity(rng["max"]),
        range_step=None if rng.get("step") is None else quantity(rng["step"]),
        has_range=valid_range is not None,
    )


def _counters(data: Any, what: str) -> dict[str, Fraction]:
    return {
        name: quantity(_dict(c, f"{what}.{name}").get("value", "0"))
        for name, c in _dict(data, what).items()
    }


def parse_node_selector(data: Any) -> NodeSelector | None:
    if data is None:
        return None
    terms = []
    for term in _list(_dict(data, "nodeSelector").get("nodeSelectorTerms"), "nodeSelectorTerms"):
        body = _dict(term, "nodeSelectorTerm")
        terms.append(
            NodeSelectorTerm(
                match_expressions=tuple(
                    _requirement(r) for r in _list(body.get("matchExpressions"), "matchExpressions")
                ),
                match_fields=tuple(
                    _requirement(r) for r in _list(body.get("matchFields"), "matchFields")
                ),
            )
        )
    return NodeSelector(tuple(terms))


def _requirement(data: Any) -> NodeSelectorRequirement:
    body = _dict(data, "requirement")
    return NodeSelectorRequirement(
        key=str(body.get("key", "")),
        operator=str(body.get("operator", "")),
        values=tuple(str(v) for v in _list(body.get("values"), "values")),
    )


def parse_device(data: Any) -> Device:
    body = _dict(data, "device")
    name = str(body.get("name", ""))
    what = f"device {name}"
    attributes = {
        key: parse_attribute(value, f"{what} attribute {key}")
        for key, value in _dict(body.get("attributes"), f"{what}.attributes").items()
    }
    capacity = {}
    for key, value in _dict(body.get("capacity"), f"{what}.capacity").items():
        cap = _dict(value, f"{what} capacity {key}")
        capacity[key] = DeviceCapacity(
            value=quantity(cap.get("value", "0")),
            policy=_policy(cap.get("requestPolicy"), f"{what} capacity {key}.requestPolicy"),
        )
    consumes = tuple(
        (
            str(_dict(c, what).get("counterSet", "")),
            _counters(_dict(c, what).get("counters"), f"{what}.consumesCounters"),
        )
        for c in _list(body.get("consumesCounters"), f"{what}.consumesCounters")
    )
    taints = tuple(
        Taint(key=str(t.get("key", "")), value=str(t.get("value", "")), effect=str(t.get("effect")))
        for t in (_dict(t, f"{what}.taints") for t in _list(body.get("taints"), what))
    )
    return Device(
        name=name,
        attributes=attributes,
        capacity=capacity,
        consumes_counters=consumes,
        taints=taints,
        allow_multiple_allocations=bool(body.get("allowMultipleAllocations") or False),
        binding_conditions=tuple(_list(body.get("bindingConditions"), what)),
        node_name=body.get("nodeName") or None,
        node_selector=parse_node_selector(body.get("nodeSelector")),
        all_nodes=bool(body.get("allNodes") or False),
    )


def parse_slice(data: Any) -> ResourceSlice:
    body = _dict(data, "ResourceSlice")
    name = str(_dict(body.get("metadata"), "metadata").get("name", ""))
    spec = _dict(body.get("spec"), f"ResourceSlice {name}.spec")
    pool = _dict(spec.get("pool"), f"ResourceSlice {name}.spec.pool")
    shared = tuple(
        (
            str(_dict(cs, "counterSet").get("name", "")),
            _counters(_dict(cs, "counterSet").get("counters"), f"ResourceSlice {name} counters"),
        )
        for cs in _list(spec.get("sharedCounters"), "sharedCounters")
    )
    return ResourceSlice(
        name=name,
        driver=str(spec.get("driver", "")),
        pool=str(pool.get("name", "")),
        generation=int(pool.get("generation", 0)),
        resource_slice_count=int(pool.get("resourceSliceCount", 0)),
        devices=tuple(parse_device(d) for d in _list(spec.get("devices"), "devices")),
        shared_counters=shared,
        node_name=spec.get("nodeName") or None,
        node_selector=parse_node_selector(spec.get("nodeSelector")),
        all_nodes=bool(spec.get("allNodes") or False),
        per_device_node_selection=bool(spec.get("perDeviceNodeSelection") or False),
    )


def _selectors(data: Any, what: str) -> tuple[str, ...]:
    expressions = []
    for selector in _list(data, what):
        cel = _dict(_dict(selector, what).get("cel"), f"{what}.cel")
        if "expression" not in cel:
            raise ParseError(f"{what}: only CEL selectors are supported")
        expressions.append(str(cel["expression"]))
    return tuple(expressions)


def parse_device_class(data: Any) -> DeviceClass:
    body = _dict(data, "DeviceClass")
    name = str(_dict(body.get("metadata"), "metadata").get("name", ""))
    spec = _dict(body.get("spec"), f"DeviceClass {name}.spec")
    return DeviceClass(
        name=name,
        selectors=_selectors(spec.get("selectors"), f"class {name}"),
        extended_resource_name=str(spec.get("extendedResourceName") or ""),
    )


def _request_spec(body: dict[str, Any], name: str, what: str) -> RequestSpec:
    capacity = body.get("capacity")
    requests = None
    if capacity is not None:
        requests = {
            key: quantity(value)
            for key, value in _dict(_dict(capacity, what).get("requests"), what).items()
        }
    return RequestSpec(
        name=name,
        device_class=str(body.get("deviceClassName", "")),
        selectors=_selectors(body.get("selectors"), what),
        mode="All" if body.get("allocationMode") == "All" else "ExactCount",
        count=int(body.get("count") or 1),
        admin_access=bool(body.get("adminAccess") or False),
        tolerations=tuple(
            Toleration(
                key=str(t.get("key") or ""),
                operator=str(t.get("operator") or "Equal"),
                value=str(t.get("value") or ""),
                effect=str(t.get("effect") or ""),
            )
            for t in (_dict(t, what) for t in _list(body.get("tolerations"), what))
        ),
        capacity_requests=requests,
    )


def parse_claim(data: Any) -> ResourceClaim:
    body = _dict(data, "ResourceClaim")
    meta = _dict(body.get("metadata"), "metadata")
    name = str(meta.get("name", ""))
    devices = _dict(_dict(body.get("spec"), "spec").get("devices"), f"claim {name}.devices")
    requests = []
    for raw in _list(devices.get("requests"), "requests"):
        req = _dict(raw, "request")
        req_name = str(req.get("name", ""))
        what = f"claim {name} request {req_name}"
        if req.get("exactly") is not None:
            exact = _request_spec(_dict(req["exactly"], what), req_name, what)
            requests.append(DeviceRequest(name=req_name, exactly=exact))
        else:
            subs = tuple(
                _request_spec(_dict(s, what), str(s.get("name", "")), f"{what}/{s.get('name')}")
                for s in _list(req.get("firstAvailable"), what)
            )
            requests.append(DeviceRequest(name=req_name, first_available=subs))
    constraints = []
    for raw in _list(devices.get("constraints"), "constraints"):
        c = _dict(raw, "constraint")
        names = tuple(str(r) for r in _list(c.get("requests"), "constraint.requests"))
        if c.get("matchAttribute"):
            constraints.append(Constraint("matchAttribute", str(c["matchAttribute"]), names))
        elif c.get("distinctAttribute"):
            constraints.append(Constraint("distinctAttribute", str(c["distinctAttribute"]), names))
        else:
            raise ParseError(f"claim {name}: constraint of an unknown type")
    allocation = None
    status_alloc = _dict(body.get("status"), "status").get("allocation")
    if status_alloc is not None:
        results = _dict(_dict(status_alloc, "allocation").get("devices"), "devices").get("results")
        allocation = tuple(
            parse_allocated_device(r, f"results[{i}]")
            for i, r in enumerate(_list(results, "results"))
        )
    return ResourceClaim(
        name=name,
        namespace=str(meta.get("namespace") or ""),
        uid=str(meta.get("uid") or ""),
        requests=tuple(requests),
        constraints=tuple(constraints),
        allocation=allocation,
    )


def parse_node(data: Any) -> Node:
    meta = _dict(_dict(data, "Node").get("metadata"), "metadata")
    labels = _dict(meta.get("labels"), "labels")
    return Node(name=str(meta.get("name", "")), labels={k: str(v) for k, v in labels.items()})
