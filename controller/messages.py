"""The words of a diagnosis: what a workload author reads in ``kubectl describe`` and from
``flexgpu explain``.

The evaluator counts devices by the first thing that rules each out; this module turns that
into sentences that name the request, how many devices match it cluster-wide, what holds the
rest (claims by name, nodes with the reason the pod cannot use them, taints, sizes) and the
nearest thing that would fit. It looks devices up in the snapshot, because the evaluator knows
device ids but not which of the pod's filters keeps a node out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property
from typing import Final

from flexgpu.controller.cluster_state import Snapshot
from flexgpu.controller.evaluation import Evaluation
from flexgpu.controller.pod_nodes import show_taint
from flexgpu.driver.allocation import (
    AllocatedState,
    RequestDiagnosis,
    ResourceSlice,
    allocated_state,
)
from flexgpu.driver.allocation.describe import device_kind, format_quantity, plural
from flexgpu.driver.allocation.explain_text import ceiling_text
from flexgpu.driver.allocation.model import Constraint, Device, RequestSpec, ResourceClaim
from flexgpu.driver.allocation.selectors import BLOCKING_TAINT_EFFECTS
from flexgpu.driver.allocation.state import DeviceId

# Events carry at most 1 KiB of message in events.k8s.io/v1; core/v1 is laxer, but the text
# must read the same through both APIs.
MAX_MESSAGE: Final = 1024
_SELECTOR_SHOWN: Final = 160
_LISTED: Final = 3


@dataclass(frozen=True)
class Located:
    slice: ResourceSlice
    device: Device

    @property
    def node(self) -> str:
        return self.device.node_name or self.slice.node_name or self.slice.pool


@dataclass
class Lookup:
    """Device facts for the words, computed at most once per snapshot."""

    snapshot: Snapshot
    _state: AllocatedState | None = field(default=None, init=False)
    # A pass words many claims over the same devices: ``nearest`` per device set, once.
    _nearest: dict[tuple[tuple[DeviceId, ...], int], str] = field(default_factory=dict, init=False)

    @cached_property
    def devices(self) -> Mapping[DeviceId, Located]:
        found: dict[DeviceId, Located] = {}
        for slc in self.snapshot.slices.values():
            for device in slc.devices:
                found.setdefault((slc.driver, slc.pool, device.name), Located(slc, device))
        return found

    @property
    def state(self) -> AllocatedState:
        if self._state is None:
            self._state = allocated_state([c.model for c in self.snapshot.claims.values()])
        return self._state


def clip(text: str, limit: int = MAX_MESSAGE) -> str:
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def _listing(items: Sequence[str], limit: int = _LISTED) -> str:
    shown = ", ".join(items[:limit])
    return f"{shown} and {len(items) - limit} more" if len(items) > limit else shown


def show_amount(value: Fraction) -> str:
    """Exact when round (``80Gi``), else to a tenth of a GiB (``79.6Gi``): published sizes
    such as 81559Mi read better that way."""
    exact = format_quantity(value)
    if value >= 2**30 and not exact.endswith(("Gi", "Ti", "Pi", "Ei")):
        return f"{float(value) / 2**30:.1f}Gi"
    return exact


def _amounts(amounts: Mapping[str, Fraction]) -> str:
    return ", ".join(f"{name} {show_amount(v)}" for name, v in sorted(amounts.items()))


def _kind(device: Device) -> tuple[Fraction, str]:
    memory = device.capacity.get("memory")
    size = memory.value if memory is not None else Fraction(0)
    kind = device_kind(device).partition(" with ")[0]
    return size, f"{kind} with {show_amount(size)}" if memory is not None else kind


def nearest(ids: Iterable[DeviceId], lookup: Lookup, limit: int = _LISTED) -> str:
    """Devices the selectors leave out, by kind, largest memory first: what comes nearest to
    a size the request asks for."""
    ids = tuple(ids)
    known = lookup._nearest.get((ids, limit))
    if known is not None:
        return known
    counts: dict[tuple[Fraction, str], int] = {}
    for i in ids:
        located = lookup.devices.get(i)
        if located is not None:
            key = _kind(located.device)
            counts[key] = counts.get(key, 0) + 1
    ordered = sorted(counts.items(), key=lambda kv: (-kv[0][0], kv[0][1]))
    text = lookup._nearest[(ids, limit)] = _listing([f"{n} {k}" for (_, k), n in ordered], limit)
    return text


def find_spec(claim: ResourceClaim, request: str) -> RequestSpec | None:
    """The request (``name``) or firstAvailable alternative (``name/sub``) a diagnosis is about."""
    name, _, sub = request.partition("/")
    for entry in claim.requests:
        if entry.name != name:
            continue
        for spec in entry.alternatives():
            if not sub or spec.name == sub:
                return spec
    return None


def _wants(d: RequestDiagnosis, spec: RequestSpec | None) -> str:
    wanted = "all devices" if d.wanted is None else plural(d.wanted, "device")
    text = f'Request "{d.request}" wants {wanted} of class {d.device_class}'
    if spec is not None and spec.selectors:
        text += f" where {clip(' && '.join(spec.selectors), _SELECTOR_SHOWN)}"
    if spec is not None and spec.capacity_requests:
        text += f" with {_amounts(spec.capacity_requests)}"
    return text + "."


def _unreachable(ids: Iterable[DeviceId], ev: Evaluation, lookup: Lookup) -> str:
    nodes = sorted({lookup.devices[i].node for i in ids if i in lookup.devices})
    excluded = ev.fit.excluded if ev.fit is not None else {}
    shown = [f"{n}: {excluded[n]}" if n in excluded else n for n in nodes]
    return f" ({_listing(shown, 2)})" if shown else ""


def _taints(ids: Iterable[DeviceId], spec: RequestSpec | None, lookup: Lookup) -> str:
    tolerations = spec.tolerations if spec is not None else ()
    seen: list[str] = []
    for i in ids:
        located = lookup.devices.get(i)
        for taint in located.device.taints if located else ():
            blocking = taint.effect in BLOCKING_TAINT_EFFECTS
            if blocking and not any(t.tolerates(taint) for t in tolerations):
                shown = show_taint(taint)
                if shown not in seen:
                    seen.append(shown)
    return f" {_listing(seen, 2)}" if seen else ""


def _largest(
    ids: Iterable[DeviceId], spec: RequestSpec | None, lookup: Lookup, *, left: bool
) -> str:
    """The most any one of these devices has (``left``: has left beside its shares) of each
    capacity the request names."""
    if spec is None or not spec.capacity_requests:
        return ""
    best: dict[str, Fraction] = {}
    for i in ids:
        located = lookup.devices.get(i)
        if located is None:
            continue
        used = lookup.state.consumed.get(i, {}) if left else {}
        for name in spec.capacity_requests:
            capacity = located.device.capacity.get(name)
            if capacity is not None:
                have = max(capacity.value - used.get(name, Fraction(0)), Fraction(0))
                best[name] = max(best.get(name, Fraction(0)), have)
    if not best:
        return ""
    return f" (the most {'left on' if left else 'on'} one: {_amounts(best)})"


def _matching(matching: int, in_class: int) -> str:
    if matching == in_class == 1:
        return "The one device in the class matches"
    if matching == in_class:
        return f"All {in_class} devices in the class match"
    verb = "matches" if matching == 1 else "match"
    return f"{matching} of the {in_class} devices in the class {verb}"


def request_text(d: RequestDiagnosis, ev: Evaluation, lookup: Lookup) -> str:
    spec = find_spec(ev.claim.model, d.request)
    head = _wants(d, spec)
    if d.in_class == 0:
        return f"{head} No device in the cluster is in that class."
    if d.matching == 0 and not d.excluded["selector_error"]:
        near = nearest(d.devices.get("not_selected", ()), lookup)
        near_text = f"; the largest are {near}" if near else ""
        return f"{head} None of the {d.in_class} devices in the class matches{near_text}."
    ids = d.devices
    parts: list[str] = []
    count = d.excluded
    if count["allocated"]:
        holders = f" ({_listing(d.holders)})" if d.holders else ""
        parts.append(f"{count['allocated']} allocated to other claims{holders}")
    if count["unreachable"]:
        where = _unreachable(ids.get("unreachable", ()), ev, lookup)
        parts.append(f"{count['unreachable']} on nodes this pod cannot use{where}")
    if count["tainted"]:
        taints = _taints(ids.get("tainted", ()), spec, lookup)
        parts.append(f"{count['tainted']} tainted{taints}, not tolerated by the request")
    if count["too_small"]:
        most = _largest(ids.get("too_small", ()), spec, lookup, left=False)
        parts.append(f"{count['too_small']} smaller than requested{most}")
    if count["capacity_used"]:
        most = _largest(ids.get("capacity_used", ()), spec, lookup, left=True)
        parts.append(
            f"{count['capacity_used']} without enough capacity left beside other shares{most}"
        )
        if d.holders and not count["allocated"]:
            parts[-1] += f", shared by {_listing(d.holders)}"
    if count["counters_spent"]:
        parts.append(f"{count['counters_spent']} overlapping partitions already allocated")
    parts.append(f"{d.free} free")
    text = f"{head} {_matching(d.matching, d.in_class)}: " + "; ".join(parts)
    ceiling = ceiling_text(d)
    if ceiling:
        text += f"; {ceiling}"
    elif d.wanted is not None and d.most_free_on_one_node < d.wanted <= d.free:
        text += f", but at most {d.most_free_on_one_node} of them on one node"
    text += "."
    if d.selector_error:
        text += (
            f" A selector fails at runtime on {plural(count['selector_error'], 'device')}"
            f" ({d.selector_error}); the scheduler gives up on the pod until it is guarded,"
            " e.g. with has()."
        )
    return text


def _attribute(located: Located, attribute: str) -> object:
    domain, _, name = attribute.rpartition("/")
    key = name if domain == located.slice.driver else attribute
    value = located.device.attributes.get(key)
    return None if value is None else value.value


def _match_ceiling(constraint: Constraint, diagnoses: Sequence[RequestDiagnosis]) -> int | None:
    """The most devices that could ever share one value for a one-request constraint."""
    if len(diagnoses) != 1 or diagnoses[0].largest_match is None:
        return None
    attribute, size = diagnoses[0].largest_match
    return size if attribute == constraint.attribute else None


def constraint_text(constraint: Constraint, ev: Evaluation, lookup: Lookup) -> str:
    """Why a constraint rules out every combination, counted over the free matching devices."""
    wanted_by = {d.request: d for d in ev.explanation.requests}
    names = constraint.requests or tuple(wanted_by)
    diagnoses = [wanted_by[n] for n in names if n in wanted_by and wanted_by[n].wanted]
    needed = sum(d.wanted or 0 for d in diagnoses)
    free = {i for d in diagnoses for i in d.devices.get("free", ())}
    groups: dict[str, dict[object, int]] = {}
    for i in free:
        located = lookup.devices.get(i)
        if located is None:
            continue
        per_node = groups.setdefault(located.node, {})
        value = _attribute(located, constraint.attribute)
        per_node[value] = per_node.get(value, 0) + 1
    short = constraint.attribute.rpartition("/")[2]
    if constraint.kind == "matchAttribute":
        best = max((n for g in groups.values() for v, n in g.items() if v is not None), default=0)
        text = (
            f"Constraint matchAttribute {constraint.attribute} needs {needed} devices with the"
            f" same {short} on one node, but at most {best} free matching devices share one"
        )
        ceiling = _match_ceiling(constraint, diagnoses)
        if ceiling is not None and ceiling < needed:
            text += (
                f", and no more than {ceiling} do even with nothing else allocated: the claim"
                f" cannot fit as written"
            )
        return text + "."
    best = max((len([v for v in g if v is not None]) for g in groups.values()), default=0)
    return (
        f"Constraint distinctAttribute {constraint.attribute} needs {needed} devices with"
        f" different {short} values on one node, but at most {best} distinct values are free."
    )


def body_text(ev: Evaluation, lookup: Lookup) -> str:
    """The requests that cannot be met, or the constraints when every request could be."""
    diagnoses = ev.explanation.requests
    short = [d for d in diagnoses if d.wanted is None or d.free < d.wanted or d.selector_error]
    if short:
        return " ".join(request_text(d, ev, lookup) for d in short)
    constraints = ev.claim.model.constraints
    if constraints:
        wants = " ".join(
            _wants(d, find_spec(ev.claim.model, d.request))[:-1]
            + f"; {plural(d.free, 'matching device')} free."
            for d in diagnoses
        )
        return f"{wants} " + " ".join(constraint_text(c, ev, lookup) for c in constraints)
    # Enough everywhere and no constraint: the requests together (or their spread over the
    # nodes) are what cannot be met; the evaluator's own summary says it best.
    return ev.explanation.message


def _nodes_text(ev: Evaluation) -> str:
    if ev.fit is None or not ev.fit.excluded:
        return ""
    total = len(ev.fit.usable) + len(ev.fit.excluded)
    if not ev.fit.usable:
        reasons = [f"{n}: {why}" for n, why in ev.fit.excluded.items()]
        return f" No node is open to the pod ({_listing(reasons, 2)})."
    return f" The pod may use {len(ev.fit.usable)} of {total} nodes."


def _claim_words(ev: Evaluation) -> str:
    extended = ev.claim.extended_resources
    if extended:
        asked = ", ".join(f"{name}: {count}" for name, count in extended)
        return f"The pod's extended resources ({asked}, served by DRA)"
    return f"Claim {ev.claim.model.name}"


def pod_message(ev: Evaluation, lookup: Lookup) -> str:
    """For the pod's Event: names the claim (or the extended resources it stands for)."""
    words = _claim_words(ev)
    if ev.explanation.outcome == "error":
        stops = "stop" if ev.claim.extended_resources else "stops"
        head = f"{words} {stops} the scheduler with an error."
    else:
        head = f"{words} cannot be allocated on any node this pod may use."
    return clip(f"{head}{_nodes_text(ev)} {body_text(ev, lookup)}")


def claim_message(ev: Evaluation, lookup: Lookup) -> str:
    """For the claim's Event: names the pod."""
    pod = ev.pod.name if ev.pod is not None else "any pod"
    if ev.explanation.outcome == "error":
        head = f"The scheduler stops with an error on this claim for pod {pod}."
    else:
        head = (
            f"Pod {pod} waits for this claim; it cannot be allocated on any node that pod may use."
        )
    return clip(f"{head}{_nodes_text(ev)} {body_text(ev, lookup)}")


def fingerprint(ev: Evaluation) -> tuple[object, ...]:
    """What makes a diagnosis a different one: the outcome, the nodes open to the pod and per
    request which reasons block devices and whether enough are free. Counts and holder names
    are left out, so a busy cluster does not re-emit an Event for every claim that comes and
    goes; the long re-emit interval refreshes those."""
    reasons = tuple(
        (
            d.request,
            tuple(sorted(r for r, n in d.excluded.items() if n)),
            d.matching == 0,
            d.wanted is None or d.free >= d.wanted,
        )
        for d in ev.explanation.requests
    )
    usable = ev.fit.usable if ev.fit is not None else ()
    return (ev.explanation.outcome, usable, reasons)
