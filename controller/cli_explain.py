"""``flexgpu explain [pod/|resourceclaim/]NAME``: why a pod's claims (or one claim) are not
satisfied, or where they are. Without a name: every waiting pod with claims in the namespace
(``-A``: in every namespace).

For each claim of the target it says one of: allocated (and, for a pod bound to a node,
whether the node prepared it or why not: the plugin's message from the kubelet's
``FailedPrepareDynamicResources`` Event; for a pod not bound yet, which of flexgpu's binding
conditions on which device of which node the scheduler still waits for, and since when),
waiting to be created (or refused: a missing or rejected ResourceClaimTemplate, from the
``FailedResourceClaimCreation`` Event), cannot be allocated and why (the controller's own
evaluation), or can be allocated. The exit status is
``ExitCode.UNSATISFIED`` when any claim is blocked, so a script can tell.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import Any, Final

from kubernetes import client

from flexgpu.controller.binding_waits import DEFAULT_GRACE_S, wait_message, waiting_pods
from flexgpu.controller.cli_cluster import ClusterRead
from flexgpu.controller.cli_options import (
    CliError,
    Connection,
    ExitCode,
    call,
)
from flexgpu.controller.evaluation import evaluate
from flexgpu.controller.messages import Lookup, claim_message, pod_message
from flexgpu.controller.pending import extended_resource_claim, our_classes
from flexgpu.controller.records import CachedClaim, PodClaimRef, PodRecord, pod_record

WIDTH: Final = 100
_POD_WORDS: Final = frozenset({"pod", "pods", "po"})
_CLAIM_WORDS: Final = frozenset(
    {"resourceclaim", "resourceclaims", "claim", "claims", "resourceclaim.resource.k8s.io"}
)


@dataclass
class Finding:
    """What holds one claim of the target, in one paragraph."""

    claim: str  # the ResourceClaim's name; "" when it does not exist
    state: str
    message: str
    blocked: bool
    entry: str = ""  # the pod's resourceClaims entry
    nodes: list[str] = field(default_factory=list)
    devices: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Target:
    kind: str  # "pod", "claim" or "" (either: a claim first, then a pod)
    namespace: str
    name: str


def parse_target(text: str, namespace: str) -> Target:
    """``NAME``, ``pod/NAME``, ``resourceclaim/NAME`` (kubectl's forms), or the older
    ``NAMESPACE/NAME``."""
    head, sep, tail = text.partition("/")
    if not sep:
        return Target("", namespace, text)
    if not head or not tail or "/" in tail:
        raise CliError(
            f"{text!r} is not a target; allowed: NAME, pod/NAME, resourceclaim/NAME",
            ExitCode.USAGE,
        )
    lowered = head.lower()
    if lowered in _POD_WORDS:
        return Target("pod", namespace, tail)
    if lowered in _CLAIM_WORDS:
        return Target("claim", namespace, tail)
    return Target("", head, tail)


# --- reading ----------------------------------------------------------------------------------


def read_or_none(
    connection: Connection, what: str, function: Any, *args: Any
) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = call(connection, what, function, *args)
    except CliError as err:
        if err.status == 404:
            return None
        raise
    return found


def _events(connection: Connection, namespace: str, kind: str, obj: dict[str, Any]) -> list[Any]:
    """The object's Events, oldest first (only this incarnation of the name)."""
    meta = obj.get("metadata") or {}
    selector = f"involvedObject.kind={kind},involvedObject.name={meta.get('name')}"
    core = client.CoreV1Api(connection.api)
    try:
        listed = call(
            connection,
            f"list Events in namespace {namespace}",
            partial(core.list_namespaced_event, namespace),
            field_selector=selector,
        )
    except CliError as err:
        if err.forbidden:
            return []  # explaining without them is still worth more than failing
        raise
    uid = meta.get("uid")
    mine = [
        e for e in listed.get("items") or [] if (e.get("involvedObject") or {}).get("uid") == uid
    ]
    return sorted(mine, key=_event_time)


def _event_time(event: dict[str, Any]) -> str:
    return str(
        event.get("lastTimestamp")
        or event.get("eventTime")
        or (event.get("metadata") or {}).get("creationTimestamp")
        or ""
    )


def _last(events: list[Any], reason: str, needle: str = "") -> str:
    for event in reversed(events):
        message = str(event.get("message") or "")
        if event.get("reason") == reason and needle in message:
            return message
    return ""


# --- explaining -------------------------------------------------------------------------------


def _allocated(claim: CachedClaim) -> Finding:
    devices = [f"{r.pool}/{r.device}" for r in claim.model.allocation or ()]
    where = f" on {', '.join(claim.allocation_nodes)}" if claim.allocation_nodes else ""
    users = f", reserved for {', '.join(claim.reserved_for)}" if claim.reserved_for else ""
    return Finding(
        claim=claim.model.name,
        state="Allocated",
        message=(
            f"Claim {claim.model.key} is allocated{where}: {', '.join(devices) or 'no devices'}"
            f"{users}."
        ),
        blocked=False,
        nodes=list(claim.allocation_nodes),
        devices=devices,
    )


def _binding(
    finding: Finding,
    claim: CachedClaim,
    wall: datetime,
    *,
    pod: PodRecord | None = None,
    pods: list[PodRecord] | None = None,
) -> None:
    """An allocated claim whose pod is not bound yet: which of flexgpu's binding conditions
    the scheduler still waits for. Blocked once past the controller's grace period, when it
    records GpuBindingConditionPending too; a shorter wait is the scheduler's usual poll.
    ``pods``: the claim's pods without a node; none, and nothing waits for the conditions."""
    if not claim.binding_pending or (pods is not None and not pods):
        return
    finding.state = "BindingPending"
    finding.message += " " + wait_message(claim, claim.allocated_at, wall, pod=pod)
    if pods:
        finding.message += f" Pods waiting: {', '.join(p.key for p in pods)}."
    since = claim.allocated_at
    finding.blocked = since is not None and (wall - since).total_seconds() >= DEFAULT_GRACE_S


def _evaluated(read: ClusterRead, claim: CachedClaim, pod: PodRecord | None) -> Finding:
    snapshot = read.snapshot
    # Without node objects a pod's node selector cannot be checked: explain the claim alone.
    ev = evaluate(snapshot, claim, pod if read.nodes_known else None)
    if ev.satisfiable:
        nodes = list(ev.explanation.allocatable_nodes)
        who = f" for pod {pod.key}" if pod is not None else ""
        message = (
            f"Claim {claim.model.key} can be allocated{who} on {', '.join(nodes)}; if a pod "
            "still waits, the reason is not its GPUs (see kubectl describe pod)."
        )
        if pod is not None and pod.pod_group:
            message += (
                f" Pod {pod.key} is a member of PodGroup {pod.pod_group}: a gang's pods are bound "
                "only once enough of them fit together, devices included (the PodGroup's "
                "PodGroupInitiallyScheduled condition says why not yet)."
            )
        return Finding(
            claim=claim.model.name,
            state="Allocatable",
            message=message,
            blocked=False,
            nodes=nodes,
        )
    lookup = Lookup(snapshot)
    text = pod_message(ev, lookup) if pod is not None else claim_message(ev, lookup)
    state = "Error" if ev.explanation.outcome == "error" else "Unsatisfiable"
    return Finding(claim=claim.model.name, state=state, message=text, blocked=True)


def _on_node(finding: Finding, pod: PodRecord, raw_pod: dict[str, Any], events: list[Any]) -> None:
    """An allocated claim of a pod bound to a node: prepared, being prepared, or failed."""
    if pod.phase in ("Running", "Succeeded", "Failed"):
        return
    failure = _last(events, "FailedPrepareDynamicResources")
    if failure:
        finding.state = "PrepareFailed"
        finding.blocked = True
        finding.message += (
            f" Node {pod.node_name} could not prepare the pod's devices; the kubelet retries. "
            f"Its last message: {failure}"
        )
        return
    statuses = (raw_pod.get("status") or {}).get("containerStatuses") or []
    waiting = [
        str((s.get("state") or {}).get("waiting", {}).get("reason") or "")
        for s in statuses
        if (s.get("state") or {}).get("waiting")
    ]
    finding.state = "Preparing"
    finding.message += (
        f" Pod {pod.key} is bound to {pod.node_name} and waits for its kubelet to prepare the "
        f"devices and start the containers ({', '.join(sorted(set(waiting))) or 'Pending'})."
    )


def _missing(
    connection: Connection,
    pod: PodRecord,
    raw_pod: dict[str, Any],
    ref: PodClaimRef,
    events: list[Any],
) -> Finding:
    """A pod's claim that does not exist: not made yet, or refused, or never to be made."""
    entries = (raw_pod.get("spec") or {}).get("resourceClaims") or []
    entry: dict[str, Any] = next((e for e in entries if e.get("name") == ref.name), {})
    refused = _last(events, "FailedResourceClaimCreation", f"PodResourceClaim {ref.name}:")
    template = entry.get("resourceClaimTemplateName")
    if template:
        resource = client.ResourceV1Api(connection.api)
        exists = read_or_none(
            connection,
            f"read ResourceClaimTemplate {template}",
            resource.read_namespaced_resource_claim_template,
            template,
            pod.namespace,
        )
        if exists is None:
            message = (
                f"Claim {ref.name} of pod {pod.key} comes from ResourceClaimTemplate "
                f"{template}, which does not exist in namespace {pod.namespace}; if applying it "
                "failed, the apply printed why. The pod cannot start until the template exists."
            )
            return Finding("", "TemplateMissing", message, True, ref.name)
        if refused:
            message = (
                f"Claim {ref.name} of pod {pod.key} could not be made from ResourceClaimTemplate "
                f"{template}: {refused}"
            )
            return Finding("", "ClaimRefused", message, True, ref.name)
        message = (
            f"Claim {ref.name} of pod {pod.key} is not made yet from ResourceClaimTemplate "
            f"{template}; the resource claim controller makes it shortly."
        )
        return Finding("", "ClaimPending", message, False, ref.name)
    name = entry.get("resourceClaimName") or ref.name
    message = (
        f"Claim {name} of pod {pod.key} does not exist in namespace {pod.namespace}; the pod "
        "waits until someone creates it."
    )
    if refused:
        message += f" {refused}"
    return Finding(str(name), "ClaimMissing", message, True, ref.name)


def explain_pod(
    connection: Connection,
    read: ClusterRead,
    raw_pod: dict[str, Any],
    wall: datetime | None = None,
) -> list[Finding]:
    wall = wall or datetime.now(UTC)
    pod = pod_record(raw_pod)
    meta = raw_pod.get("metadata") or {}
    key = f"{meta.get('namespace')}/{meta.get('name')}"
    snapshot = read.snapshot
    extended = (
        extended_resource_claim(pod, snapshot.classes, our_classes(snapshot.classes))
        if pod is not None and not pod.node_name
        else None
    )
    if pod is None or (not pod.claims and extended is None):
        raise CliError(
            f"pod {key} uses no ResourceClaim and no extended resource a flexgpu DeviceClass "
            "serves",
            ExitCode.NOT_FOUND,
        )
    events = _events(connection, pod.namespace, "Pod", raw_pod)
    findings = []
    for ref in pod.claims:
        claim = read.snapshot.claims.get(f"{pod.namespace}/{ref.claim}") if ref.claim else None
        if claim is None:
            findings.append(_missing(connection, pod, raw_pod, ref, events))
            continue
        if claim.allocated:
            finding = _allocated(claim)
            if pod.node_name:
                _on_node(finding, pod, raw_pod, events)
            else:
                _binding(finding, claim, wall, pod=pod)
        elif pod.node_name:
            finding = Finding(
                claim.model.name,
                "NotScheduled",
                f"Pod {pod.key} was bound to {pod.node_name} without the scheduler "
                f"(spec.nodeName), so nothing allocates claim {claim.model.name}: the pod waits "
                "on that node for ever. Let the scheduler place it: use a nodeSelector on "
                "kubernetes.io/hostname instead.",
                True,
            )
        else:
            finding = _evaluated(read, claim, pod)
            nominated = (raw_pod.get("status") or {}).get("nominatedNodeName")
            if nominated:
                finding.message += (
                    f" The scheduler nominated node {nominated} and waits for pods there to "
                    "end (preemption)."
                )
        finding.entry = ref.name
        findings.append(finding)
    if extended is not None:
        findings.append(_evaluated(read, extended, pod))
    return findings


def explain_claim(
    read: ClusterRead, claim: CachedClaim, wall: datetime | None = None
) -> list[Finding]:
    if claim.allocated:
        finding = _allocated(claim)
        _binding(finding, claim, wall or datetime.now(UTC), pods=waiting_pods(read.snapshot, claim))
        return [finding]
    waiting = next(
        (
            p
            for p in sorted(read.snapshot.pods.values(), key=lambda p: p.name)
            if not p.node_name and claim.model.key in p.claim_keys()
        ),
        None,
    )
    return [_evaluated(read, claim, waiting)]
