"""An explanation in a workload author's words: one sentence per request, and the paragraph
for the claim."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from flexgpu.driver.allocation.allocator import Outcome
from flexgpu.driver.allocation.describe import plural
from flexgpu.driver.allocation.explain_model import Explanation, RequestDiagnosis
from flexgpu.driver.allocation.model import Device, ResourceClaim

_PHRASES = {
    "unreachable": "on nodes the pod cannot use",
    "allocated": "allocated to other claims",
    "tainted": "tainted (no matching toleration)",
    "too_small": "too small for the requested capacity",
    "capacity_used": "without enough capacity left beside existing shares",
    "counters_spent": "overlapping partitions that are already allocated",
}


def with_message(d: RequestDiagnosis, _all: Sequence[Device]) -> RequestDiagnosis:
    wanted = "all devices" if d.wanted is None else plural(d.wanted, "device")
    parts = [f"request {d.request} wants {wanted} of class {d.device_class}"]
    if d.in_class == 0:
        parts.append("no device in the cluster matches the class")
    else:
        parts.append(f"{d.matching} of the {d.in_class} devices in the class match its selectors")
        blocked = [f"{d.excluded[r]} {phrase}" for r, phrase in _PHRASES.items() if d.excluded[r]]
        if blocked:
            holders = f" ({', '.join(d.holders[:3])})" if d.holders else ""
            parts.append("of those, " + "; ".join(blocked) + holders)
        parts.append(f"{d.free} free")
        if d.excluded["not_selected"]:
            parts.append(f"not selected: {d.near_misses}")
        if d.selector_error:
            parts.append(
                f"a selector fails at runtime on {plural(d.excluded['selector_error'], 'device')}"
                f" ({d.selector_error}); the scheduler gives up on the pod until it is fixed,"
                " e.g. guarded with has()"
            )
        ceiling = ceiling_text(d)
        if ceiling:
            parts.append(ceiling)
        elif d.wanted is not None and d.most_free_on_one_node < d.wanted <= d.free:
            parts.append(f"but at most {d.most_free_on_one_node} of them are on one node")
    return _replace_message(
        d, ", ".join(parts[:2]) + ("; " + "; ".join(parts[2:]) if parts[2:] else "") + "."
    )


def ceiling_text(d: RequestDiagnosis) -> str:
    """Why the request can never fit as written, whatever ends ("" when it might): more
    devices than any usable node has, or than share one value of its matchAttribute."""
    if d.wanted is None or not d.matching:
        return ""
    most = d.most_on_one_node
    if most and d.wanted > most:
        return (
            f"no node the pod may use has more than {most} of them even with nothing else "
            f"allocated, and a pod's devices all come from its own node: ask for at most "
            f"{most} per pod"
        )
    if d.largest_match and d.largest_match[1] and d.wanted > d.largest_match[1]:
        attribute, size = d.largest_match
        return (
            f"its matchAttribute constraint on {attribute} allows at most {size} together "
            f"(the most devices of one node sharing one value) even with nothing else allocated"
        )
    return ""


def _replace_message(d: RequestDiagnosis, message: str) -> RequestDiagnosis:
    return RequestDiagnosis(**{**d.__dict__, "message": message})


def for_claim(explanation: Explanation, claim_key: str) -> Explanation:
    """The same explanation about another claim that asks for the same devices: only the
    paragraph's head names the claim (request texts and holders never name it)."""
    head = f"Claim {explanation.claim} "
    message = explanation.message
    if message.startswith(head):
        message = f"Claim {claim_key} " + message[len(head) :]
    return replace(explanation, claim=claim_key, message=message)


def claim_paragraph(
    claim: ResourceClaim,
    outcome: Outcome,
    allocatable: list[str],
    diagnoses: Sequence[RequestDiagnosis],
    verdict: object,
) -> str:
    if outcome == "allocatable":
        return f"Claim {claim.key} can be allocated on {', '.join(allocatable)}."
    if outcome == "error":
        reasons = {v.reason for v in getattr(verdict, "per_node", ()) if v.outcome == "error"}
        head = (
            f"Claim {claim.key} cannot be scheduled: the scheduler stops with an error "
            f"({'; '.join(sorted(reasons))})."
        )
    else:
        head = f"Claim {claim.key} cannot be allocated on any node the pod may use."
    body = " ".join(d.message for d in diagnoses)
    enough = [d for d in diagnoses if d.wanted is not None and d.free >= d.wanted]
    tail = ""
    if (
        outcome == "unallocatable"
        and claim.constraints
        and enough
        and len(enough) == len(diagnoses)
    ):
        names = ", ".join(f"{c.kind} {c.attribute}" for c in claim.constraints)
        tail = (
            f" Each request has enough free devices on its own, so the claim's constraints "
            f"({names}) or the requests together rule out every combination."
        )
    return f"{head} {body}{tail}".strip()
