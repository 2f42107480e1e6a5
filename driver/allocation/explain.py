"""Why a claim cannot be allocated, per request, in a workload author's words.

The verdict comes from the allocator over the nodes the pod may use. The explanation then looks
at every device of the cluster's current pools, once per request (each ``firstAvailable``
alternative separately), and sorts those in the request's class by the first thing that rules
them out: a selector that fails at runtime, the request's selectors, a node the pod cannot use,
an allocation to another claim, an untolerated taint, too little capacity (in total, or left
beside other shares), shared counters spent by allocated partitions. What is left is free. When
enough devices are free one by one, the constraints or the spread over nodes are to blame.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from flexgpu.driver.allocation import capacity as cap
from flexgpu.driver.allocation.allocator import (
    NOT_ALLOCATABLE,
    Verdict,
    allocate,
)
from flexgpu.driver.allocation.anywhere import ClusterVerdict, allocate_anywhere
from flexgpu.driver.allocation.cel import SelectorError
from flexgpu.driver.allocation.describe import summarize_kinds
from flexgpu.driver.allocation.explain_limits import HELD_OR_FREE, count_serving, largest_match
from flexgpu.driver.allocation.explain_model import REASONS, Explanation, RequestDiagnosis
from flexgpu.driver.allocation.explain_text import claim_paragraph, with_message
from flexgpu.driver.allocation.model import (
    Device,
    DeviceCapacity,
    DeviceClass,
    Node,
    RequestSpec,
    ResourceClaim,
    ResourceSlice,
)
from flexgpu.driver.allocation.nodes import node_matches
from flexgpu.driver.allocation.pools import Pool, SliceIndex, slice_visible
from flexgpu.driver.allocation.selectors import SelectorCache, tainted
from flexgpu.driver.allocation.state import AllocatedState, DeviceId, allocated_state


@dataclass(frozen=True)
class _Seen:
    pool: Pool
    slice: ResourceSlice
    device: Device
    id: DeviceId  # (driver, pool, device): read for every device of every explanation


def _cluster_devices(index: SliceIndex, nodes: Sequence[Node]) -> list[_Seen]:
    """Every device of a usable pool that some node can see, once, in allocation order;
    kept with the index for the same nodes."""
    key = ("explain.cluster_devices", tuple(n.name for n in nodes))
    known = index.derived.get(key)
    if known is None:
        known = index.derived[key] = _gather_devices(index, nodes)
    return list(known)


def _in_class(
    index: SliceIndex,
    nodes: Sequence[Node],
    devices: Sequence[_Seen],
    device_class: DeviceClass,
    selectors: SelectorCache,
) -> list[_Seen]:
    """The devices a class selects, or whose class selectors fail on them (those count as in
    the class, with a selector error); kept with the index, as class selectors read only the
    device. Every other device is out of the explanation anyway."""
    key = _class_key(nodes, device_class)
    known = index.derived.get(key)
    if known is None:
        known = []
        for seen in devices:
            try:
                if not selectors.matches(
                    device_class.selectors, seen.slice.driver, seen.device, "class"
                ):
                    continue
            except SelectorError:
                pass
            known.append(seen)
        index.derived[key] = known
    return list(known)


def _class_key(nodes: Sequence[Node], device_class: DeviceClass) -> tuple[object, ...]:
    names = tuple(n.name for n in nodes)
    return ("explain.in_class", names, device_class.name, tuple(device_class.selectors))


def _gather_devices(index: SliceIndex, nodes: Sequence[Node]) -> list[_Seen]:
    found: dict[DeviceId, _Seen] = {}
    for node in nodes:
        for pool in index.pools(node):
            if not pool.usable:
                continue
            for slc in pool.device_slices:
                for device in slc.devices:
                    did = (pool.driver, pool.name, device.name)
                    if did not in found:
                        found[did] = _Seen(pool, slc, device, did)
    return list(found.values())


def _reachable(seen: _Seen, node: Node) -> bool:
    if seen.slice.per_device_node_selection:
        d = seen.device
        return node_matches(node, d.node_name, d.all_nodes, d.node_selector)
    return slice_visible(seen.slice, node)


@dataclass(frozen=True)
class _Usable:
    """The nodes a pod may use, with their names for the common case of a slice that names
    its node (reachable exactly when that node is usable: no walk over every node)."""

    nodes: Sequence[Node]
    names: frozenset[str]

    def reachable(self, seen: _Seen) -> bool:
        if seen.slice.node_name and not seen.slice.per_device_node_selection:
            return seen.slice.node_name in self.names
        return any(_reachable(seen, n) for n in self.nodes)

    def reaching(self, seen: _Seen) -> list[str]:
        if seen.slice.node_name and not seen.slice.per_device_node_selection:
            return [seen.slice.node_name] if seen.slice.node_name in self.names else []
        return [n.name for n in self.nodes if _reachable(seen, n)]


_FreeCounters = dict[tuple[str, str], dict[str, dict[str, Fraction]]]


def _counters_spent(seen: _Seen, state: AllocatedState, pools: _FreeCounters) -> bool:
    """Whether allocated devices spent counters this device needs; ``pools`` keeps each
    pool's free counters for one state (a pool has many partitions to ask about)."""
    if not seen.device.consumes_counters:
        return False
    free = pools.get(seen.pool.key)
    if free is None:
        free = pools[seen.pool.key] = _free_counters(seen.pool, state)
    return any(
        free.get(set_name, {}).get(counter, Fraction(0)) < amount
        for set_name, counters in seen.device.consumes_counters
        for counter, amount in counters.items()
    )


def _free_counters(pool: Pool, state: AllocatedState) -> dict[str, dict[str, Fraction]]:
    free = {name: dict(c) for name, c in pool.counter_sets.items()}
    for slc in pool.all_device_slices:
        for device in slc.devices:
            if state.is_allocated((pool.driver, pool.name, device.name)):
                for set_name, counters in device.consumes_counters:
                    cap.add_amounts(free.setdefault(set_name, {}), counters, -1)
    return free


# What rules a device out whatever the cluster's state and the pod's nodes: the request's
# selectors, its tolerations, its capacity against the device's size. One code per device of
# the class, worked out once per snapshot and kind of request (pending claims come in crowds
# asking the same), so an explanation only checks what allocations and nodes change.
_FREE = 0
_SELECTOR_ERROR = 1
_NOT_SELECTED = 2
_TAINTED = 4
_TOO_SMALL = 8


@dataclass(frozen=True)
class _Static:
    codes: bytes  # one per device of the class, in its order
    near_misses: str  # summary of the devices the request's selectors leave out


def _static(
    index: SliceIndex,
    class_key: tuple[object, ...],
    spec: RequestSpec,
    *,
    device_class: DeviceClass,
    devices: Sequence[_Seen],
    selectors: SelectorCache,
) -> _Static:
    requests = spec.capacity_requests
    key = (
        "explain.static",
        class_key,
        spec.selectors,
        spec.tolerations,
        None if requests is None else tuple(sorted(requests.items())),
    )
    known = index.derived.get(key)
    if isinstance(known, _Static):
        return known
    codes = bytearray(len(devices))
    near: list[Device] = []
    sizes: dict[tuple[tuple[str, DeviceCapacity], ...], bool] = {}
    for i, seen in enumerate(devices):
        driver, device = seen.slice.driver, seen.device
        try:
            selectors.matches(device_class.selectors, driver, device, "class")
            if not selectors.matches(spec.selectors, driver, device, "request"):
                codes[i] = _NOT_SELECTED
                near.append(device)
                continue
        except SelectorError:
            codes[i] = _SELECTOR_ERROR
            continue
        code = _TAINTED if tainted(device, spec) else _FREE
        # Devices of one model publish equal capacities: size them once per kind.
        size = tuple(device.capacity.items())
        big_enough = sizes.get(size)
        if big_enough is None:
            big_enough = sizes[size] = cap.fits(requests, device.capacity)
        codes[i] = code if big_enough else code | _TOO_SMALL
    static = _Static(bytes(codes), summarize_kinds(near))
    index.derived[key] = static
    return static


def _reason(
    seen: _Seen,
    code: int,
    *,
    spec: RequestSpec,
    state: AllocatedState,
    usable_nodes: _Usable,
    counters: _FreeCounters,
) -> str | None:
    """Why the device cannot serve the request (a REASONS entry), None if free; ``code`` is
    the device's ``_static`` code (the checks that need neither state nor nodes)."""
    if code & (_SELECTOR_ERROR | _NOT_SELECTED):
        return "selector_error" if code & _SELECTOR_ERROR else "not_selected"
    if not usable_nodes.reachable(seen):
        return "unreachable"
    device, did = seen.device, seen.id
    shared = device.allow_multiple_allocations
    if not spec.admin_access and not shared and did in state.exclusive:
        return "allocated"
    if code & _TAINTED:
        return "tainted"
    if code & _TOO_SMALL:
        return "too_small"
    used = state.consumed.get(did)
    if used and not cap.fits(spec.capacity_requests, device.capacity, used):
        return "capacity_used"
    if not (shared and (did in state.shared or did in state.consumed)) and _counters_spent(
        seen, state, counters
    ):
        return "counters_spent"
    return None


def diagnose_request(
    name: str,
    *,
    spec: RequestSpec,
    device_class: DeviceClass,
    devices: Sequence[_Seen],
    state: AllocatedState,
    usable_nodes: Sequence[Node],
    selectors: SelectorCache,
    static: _Static,
    match_attributes: Sequence[str] = (),
) -> RequestDiagnosis:
    """``match_attributes``: the attributes of the claim's matchAttribute constraints that
    apply to this request."""
    excluded = dict.fromkeys(REASONS, 0)
    by_reason: dict[str, list[DeviceId]] = {}
    in_class = free = 0
    holders: set[str] = set()
    free_per_node: dict[str, int] = {}
    room: dict[str, float] = {}
    error = ""
    usable = _Usable(usable_nodes, frozenset(n.name for n in usable_nodes))
    counters: _FreeCounters = {}
    # Node -> devices that would serve the request with nothing else allocated; and per
    # matchAttribute constraint, (node, value) -> such devices sharing that value.
    serving_per_node: dict[str, int] = {}
    per_value: dict[str, dict[tuple[str, str], int]] = {a: {} for a in match_attributes}
    for seen, code in zip(devices, static.codes, strict=True):
        reason = _reason(seen, code, spec=spec, state=state, usable_nodes=usable, counters=counters)
        in_class += 1
        by_reason.setdefault(reason or "free", []).append(seen.id)
        if reason in HELD_OR_FREE:
            count_serving(
                usable.reaching(seen), seen.device, seen.slice.driver, serving_per_node, per_value
            )
        if reason is None:
            free += 1
            for node_name in usable.reaching(seen):
                free_per_node[node_name] = free_per_node.get(node_name, 0) + 1
                if seen.device.allow_multiple_allocations:
                    room[node_name] = float("inf")
            continue
        excluded[reason] += 1
        if reason == "selector_error" and not error:
            error = _selector_error(seen, spec, device_class, selectors)
        elif reason in ("allocated", "capacity_used", "counters_spent"):
            holders.update(state.holders.get(seen.id, []))
    matching = in_class - excluded["not_selected"] - excluded["selector_error"]
    diagnosis = RequestDiagnosis(
        request=name,
        device_class=device_class.name,
        wanted=None if spec.mode == "All" else spec.count,
        in_class=in_class,
        matching=matching,
        free=free,
        excluded=excluded,
        most_free_on_one_node=max(free_per_node.values(), default=0),
        holders=tuple(sorted(holders)),
        near_misses=static.near_misses,
        selector_error=error,
        devices={reason: tuple(ids) for reason, ids in by_reason.items()},
        room={n: max(room.get(n, 0.0), float(k)) for n, k in free_per_node.items()},
        most_on_one_node=max(serving_per_node.values(), default=0),
        largest_match=largest_match(per_value),
    )
    return with_message(diagnosis, [s.device for s in devices])


def _selector_error(
    seen: _Seen, spec: RequestSpec, device_class: DeviceClass, selectors: SelectorCache
) -> str:
    try:
        selectors.matches(device_class.selectors, seen.slice.driver, seen.device, "class")
        selectors.matches(spec.selectors, seen.slice.driver, seen.device, "the request")
    except SelectorError as err:
        return err.message
    return ""


def explain_claim(
    claim: ResourceClaim,
    slices: Sequence[ResourceSlice],
    classes: Mapping[str, DeviceClass],
    claims: Sequence[ResourceClaim],
    nodes: Sequence[Node],
    *,
    usable_nodes: Sequence[str] | None = None,
    selectors: SelectorCache | None = None,
    state: AllocatedState | None = None,
    index: SliceIndex | None = None,
) -> Explanation:
    """Explains ``claim`` against the cluster: ``claims`` give what others hold, ``usable_nodes``
    names the nodes the pod may run on (all of ``nodes`` when None). Callers explaining many
    claims over one cluster may pass ``selectors``, shared across calls over the same devices
    (see ``SelectorCache``), and ``state``, ``allocated_state`` of ``claims`` computed once; it
    must not count ``claim`` itself (an unallocated claim never does); and ``index``, a
    ``SliceIndex`` of ``slices``, shared likewise."""
    wanted = set(usable_nodes) if usable_nodes is not None else None
    usable = [n for n in nodes if wanted is None or n.name in wanted]
    if state is None or claim.allocation:
        state = allocated_state(claims, skip=[claim.key])
    selectors = selectors or SelectorCache()
    index = index or SliceIndex(slices)
    devices = _cluster_devices(index, nodes)
    diagnoses = []
    rooms: list[list[tuple[RequestSpec, RequestDiagnosis]]] = []
    for request in claim.requests:
        rooms.append([])
        for spec in request.alternatives():
            name = request.name if request.exactly is not None else f"{request.name}/{spec.name}"
            device_class = classes.get(spec.device_class)
            if device_class is None:
                diagnoses.append(
                    RequestDiagnosis(
                        request=name,
                        device_class=spec.device_class,
                        wanted=spec.count,
                        in_class=0,
                        matching=0,
                        free=0,
                        excluded=dict.fromkeys(REASONS, 0),
                        most_free_on_one_node=0,
                        message=f"request {name}: device class {spec.device_class} does not exist.",
                    )
                )
                continue
            matched = [
                c.attribute
                for c in claim.constraints
                if c.kind == "matchAttribute"
                and (not c.requests or request.name in c.requests or name in c.requests)
            ]
            in_class = _in_class(index, nodes, devices, device_class, selectors)
            class_key = _class_key(nodes, device_class)
            diagnoses.append(
                diagnose_request(
                    name,
                    spec=spec,
                    device_class=device_class,
                    devices=in_class,
                    state=state,
                    usable_nodes=usable,
                    selectors=selectors,
                    static=_static(
                        index,
                        class_key,
                        spec,
                        device_class=device_class,
                        devices=in_class,
                        selectors=selectors,
                    ),
                    match_attributes=matched,
                )
            )
            rooms[-1].append((spec, diagnoses[-1]))
    verdict = _verdict(
        claim,
        usable,
        index=index,
        classes=classes,
        state=state,
        selectors=selectors,
        rooms=rooms,
    )
    return Explanation(
        claim=claim.key,
        outcome=verdict.outcome,
        allocatable_nodes=tuple(verdict.allocatable_nodes),
        requests=tuple(diagnoses),
        message=claim_paragraph(
            claim, verdict.outcome, verdict.allocatable_nodes, diagnoses, verdict
        ),
    )


def _verdict(
    claim: ResourceClaim,
    usable: Sequence[Node],
    *,
    index: SliceIndex,
    classes: Mapping[str, DeviceClass],
    state: AllocatedState,
    selectors: SelectorCache,
    rooms: Sequence[Sequence[tuple[RequestSpec, RequestDiagnosis]]],
) -> ClusterVerdict:
    """The allocator's verdict, searching only the nodes where every request has as many free
    matching devices as it wants. A node short of them cannot take the claim, so the search
    there is skipped, unless it could end otherwise than "unallocatable": a selector failing
    at runtime, an ``All`` request, a missing class (these search everywhere, as before), or
    an invalid pool on the node (searched, for its reason). In a full cluster this leaves
    few nodes to search."""
    prunable = all(
        alternatives
        and all(
            spec.mode == "ExactCount"
            and spec.device_class in classes
            and not d.excluded["selector_error"]
            for spec, d in alternatives
        )
        for alternatives in rooms
    )
    if not prunable:
        return allocate_anywhere(
            [claim], usable, index.slices, classes, state, selectors=selectors, index=index
        )
    verdicts = []
    for node in usable:
        has_room = all(
            any(d.room.get(node.name, 0.0) >= spec.count for spec, d in alternatives)
            for alternatives in rooms
        )
        if has_room or not all(p.usable for p in index.pools(node)):
            verdicts.append(
                allocate(
                    [claim], node, index.slices, classes, state, selectors=selectors, index=index
                )
            )
        else:
            verdicts.append(Verdict("unallocatable", node.name, reason=NOT_ALLOCATABLE))
    if any(v.outcome == "error" for v in verdicts):
        return ClusterVerdict("error", tuple(verdicts))
    if any(v.allocatable for v in verdicts):
        return ClusterVerdict("allocatable", tuple(verdicts))
    return ClusterVerdict("unallocatable", tuple(verdicts))
