"""Which pods GPU clearing may move, and which it must leave to end.

Clearing (``driver.allocation.clearing``) only keeps new claims off a GPU; its holders run
on. Where the admin turns eviction on, a GPU that has been steered for longer than a bound
may be emptied faster by evicting its holders' pods, under three rules:

- a pod moves only with its owner's consent, given one of two ways: the annotation
  ``flexgpu.dev/movable: "true"`` on the pod (so on the pod template of the workload that
  makes it), or a PodDisruptionBudget of its namespace that selects it (the budget is the
  owner's statement of how many of its pods may be disrupted at once, and the Eviction API
  holds every eviction to it). ``flexgpu.dev/movable: "false"`` refuses, whatever budget
  selects the pod. A pod that more than one budget selects never moves: the Eviction API
  refuses such pods;
- and only when something makes it again elsewhere: its controlling owner is a ReplicaSet
  (so a Deployment), a StatefulSet or a ReplicationController. A Job's pod never moves (an
  evicted Job pod counts as a failure against the Job's backoff limit, and its work is lost);
  a bare pod never moves (nothing makes it again); other owners are not known to recreate;
- and only when evicting the pod frees the device: the holding claim was generated for that
  pod from a ResourceClaimTemplate (controlled by the pod, deleted with it). A claim made by
  name stays allocated when its pod goes, and the pod's replacement would take the same
  device again.

Consent never overrides the other two rules: a Job's pod stays, annotated or budgeted.

A GPU is emptied by eviction only when every holder may move (or is ending already): while
one holder must end on its own, evicting the others would cost them a restart and still not
let the waiting claim in. Nor is it emptied while a moving pod's claims would fit nowhere
else now (``driver.allocation.relocation``): its replacement would only wait. Evictions go
through the Eviction API, so PodDisruptionBudgets are honoured; the controller
(``controller.place_eviction``) makes the calls and bounds how many are in flight, and
reads the holders' pods; this module only decides, from what it is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

MOVABLE_ANNOTATION: Final = "flexgpu.dev/movable"
# Controllers (as "Kind.group") that make an evicted pod again, somewhere the scheduler picks.
RECREATING_OWNERS: Final = frozenset(
    {"ReplicaSet.apps", "StatefulSet.apps", "ReplicationController"}
)
JOB_OWNER: Final = "Job.batch"


@dataclass(frozen=True)
class HolderPod:
    """The pod a holding claim was generated for, as far as moving it is concerned."""

    namespace: str
    name: str
    uid: str
    # The value of its flexgpu.dev/movable annotation; None when it has none.
    movable: str | None
    controller: str  # its controlling owner as "Kind.group"; "" for none
    ending: bool  # being deleted, or finished (Succeeded, Failed)
    deleting: bool = False  # being deleted: what counts as an eviction in flight
    # The PodDisruptionBudgets of its namespace that select it, by name.
    budgets: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


def consent(pod: HolderPod) -> str | None:
    """How the pod's owner consented to its moving, in words for an Event; None when it did
    not."""
    if pod.movable == "true":
        return f'the pod carries {MOVABLE_ANNOTATION}: "true"'
    if pod.movable is None and len(pod.budgets) == 1:
        return f"PodDisruptionBudget {pod.namespace}/{pod.budgets[0]} selects the pod"
    return None


@dataclass(frozen=True)
class Holder:
    """One claim allocated a device of the GPU being cleared."""

    claim: str  # namespace/name
    # The pod the claim was generated for; None when the claim was made by name, or when
    # its pod is gone (the claim follows it).
    pod: HolderPod | None
    generated: bool = True  # the claim is controlled by a pod (a template's claim)


def why_not_movable(holder: Holder) -> str | None:
    """Why the holder's pod may not be evicted, in words for an Event; None when it may."""
    pod = holder.pod
    if not holder.generated:
        return (
            f"claim {holder.claim} is not generated for one pod: it stays allocated when a "
            "pod using it goes"
        )
    if pod is None:
        return f"the pod claim {holder.claim} was generated for is gone"
    if pod.controller == JOB_OWNER:
        return f"pod {pod.key} belongs to a Job: a Job's pods are never evicted"
    if pod.movable not in (None, "true", "false"):
        return (
            f'pod {pod.key} carries {MOVABLE_ANNOTATION}: "{pod.movable}": allowed are "true" '
            '(it may be evicted) and "false" (it may not); anything else counts as no consent'
        )
    if pod.movable == "false":
        return (
            f'pod {pod.key} carries {MOVABLE_ANNOTATION}: "false": it refused, whatever '
            "PodDisruptionBudget selects it"
        )
    if len(pod.budgets) > 1:
        budgets = ", ".join(pod.budgets)
        return (
            f"pod {pod.key} is selected by more than one PodDisruptionBudget ({budgets}): the "
            "Eviction API refuses such pods"
        )
    if consent(pod) is None:
        return (
            f'pod {pod.key} did not consent: it carries no {MOVABLE_ANNOTATION}: "true" and no '
            "PodDisruptionBudget of its namespace selects it"
        )
    if not pod.controller:
        return f"pod {pod.key} has no controller that makes it again"
    if pod.controller not in RECREATING_OWNERS:
        return f"pod {pod.key} is owned by a {pod.controller}, not known to make it again"
    return None


@dataclass(frozen=True)
class GpuPlan:
    """What eviction may do for one GPU being cleared."""

    evict: tuple[HolderPod, ...]  # may move and not ending yet, in claim order
    ending: tuple[HolderPod, ...]  # already on their way out
    # (claim, why) for holders that must end on their own; evict is empty when any is.
    waits_for: tuple[tuple[str, str], ...]


def plan_gpu(holders: Sequence[Holder]) -> GpuPlan:
    evict: list[HolderPod] = []
    ending: list[HolderPod] = []
    waits: list[tuple[str, str]] = []
    for holder in sorted(holders, key=lambda h: h.claim):
        if holder.generated and holder.pod is None:
            continue  # its pod is gone: the claim is deleted after it, nothing waits on it
        if holder.pod is not None and holder.pod.ending:
            ending.append(holder.pod)
            continue
        reason = why_not_movable(holder)
        if reason is not None:
            waits.append((holder.claim, reason))
        elif holder.pod is not None and holder.pod not in evict:
            evict.append(holder.pod)  # once, though two of its claims hold the GPU
    return GpuPlan(
        evict=() if waits else tuple(evict), ending=tuple(ending), waits_for=tuple(waits)
    )


K = TypeVar("K")


def choose(
    plans: Sequence[tuple[K, GpuPlan]], in_flight: int, max_in_flight: int
) -> list[tuple[K, HolderPod]]:
    """The pods to evict now, at most ``max_in_flight - in_flight`` of them, taking the plans
    in the order given (the caller's: longest-steered GPU first), so one GPU is emptied
    before the next is started on."""
    room = max(0, max_in_flight - in_flight)
    chosen: list[tuple[K, HolderPod]] = []
    for key, plan in plans:
        for pod in plan.evict:
            if len(chosen) >= room:
                return chosen
            chosen.append((key, pod))
    return chosen
