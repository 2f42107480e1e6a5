"""Which nodes of a group to let empty, so that an autoscaler can remove them.

cluster-autoscaler and Karpenter remove a GPU node only once no claim holds a device there.
The scheduler puts a new claim wherever it fits, so a node whose last holders are ending
keeps receiving new small claims and is paid for all day. Steering keeps new claims off a few
chosen nodes (a NoSchedule device taint on their devices, as GPU clearing does for one GPU,
``driver.allocation.clearing``) so that they empty as their holders end. Nothing here moves
anyone; which holders may be moved is ``driver.allocation.consolidation``'s rule. This module
only decides, from what it is given:

- **who may be steered**: nodes that serve now (a booting node was launched for claims that
  wait), holding at most ``max_held_share`` of their GPUs (0.5, as cluster-autoscaler's
  ``--scale-down-utilization-threshold`` default: a fuller node is not worth emptying);
- **the room rule**: a node is steered only when the group's other nodes, not steered, have
  free room (GPU-equivalents) for everything it holds now on top of what the nodes already
  chosen hold: the rest of the group could take the node's work again, so what arrives next
  has somewhere to go. The rule is in GPU-equivalents, blind to how partitions fit; what it
  misses is caught by the release below;
- **order**: nodes steered already first (a taint that comes and goes costs API writes and
  Events and empties nothing), then by ``NodeCandidate.score``: fewest pinned holders (where
  eviction is on, a holder whose pod may move is not pinned: a node of such holders can be
  emptied within eviction's bound, one holding a Job only when the Job ends; with eviction
  off every holder is pinned and this key changes nothing), then fewest holders, then the
  soonest end (the last holder's expected end where every holder's is known; otherwise the
  youngest holder's age, older first: of work of similar length, what has run longest has
  least left), then the least held, then the name;
- **the bound**: at most ``clearing.steering_limit(total GPUs, share)`` GPUs steered at
  once, a node counting all its GPUs;
- **release**: a claim that fits on no node but a steered one releases one of them
  (``release_for``): steering never makes a claim wait that fits somewhere now.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

from flexgpu.driver.allocation.clearing import steering_limit

# cluster-autoscaler's --scale-down-utilization-threshold default.
DEFAULT_MAX_HELD_SHARE: Final = 0.5
_EPSILON: Final = 1e-9  # GPU-equivalents are sums of fractions such as 1/8


@dataclass(frozen=True)
class NodeHolder:
    """One claim allocated devices of the node."""

    claim: str  # namespace/name
    gpus: float  # GPU-equivalents it holds (a 1g.10gb partition of an 8-slice GPU: 1/8)
    age_s: float  # since it was allocated
    remaining_s: float | None = None  # expected time left, where something says so
    # Its pod may be evicted to empty the node (``consolidation``'s rule), where eviction is on.
    movable: bool = False


@dataclass(frozen=True)
class GroupNode:
    """A node of the group that serves claims now, with what it holds."""

    name: str
    gpus: int
    holders: tuple[NodeHolder, ...] = ()

    @property
    def held(self) -> float:
        return sum(h.gpus for h in self.holders)

    @property
    def free(self) -> float:
        return max(0.0, self.gpus - self.held)


@dataclass(frozen=True)
class NodeCandidate:
    node: GroupNode

    @property
    def ends_in_s(self) -> float:
        """When the last holder is expected to end; infinite unless every holder's is known
        (an empty node: now)."""
        remaining = [h.remaining_s for h in self.node.holders]
        if any(r is None for r in remaining):
            return math.inf
        return max((r for r in remaining if r is not None), default=0.0)

    @property
    def pinned(self) -> int:
        """Holders that only their own end takes off the node (nobody may move them)."""
        return sum(1 for h in self.node.holders if not h.movable)

    @property
    def score(self) -> tuple[int, int, float, float, float, str]:
        """Lower is better: fewest pinned holders, fewest holders, soonest expected end,
        oldest youngest holder, least held, then the name so that equal nodes are chosen the
        same way every pass."""
        node = self.node
        youngest = min((h.age_s for h in node.holders), default=math.inf)
        return (
            self.pinned,
            len(node.holders),
            self.ends_in_s,
            -youngest,
            round(node.held, 6),
            node.name,
        )


def may_steer(node: GroupNode, max_held_share: float = DEFAULT_MAX_HELD_SHARE) -> bool:
    return node.gpus > 0 and node.held <= node.gpus * max_held_share + _EPSILON


def choose_nodes(
    nodes: Sequence[GroupNode],
    *,
    total_gpus: int,
    share: float,
    steered: Iterable[str] = (),
    max_held_share: float = DEFAULT_MAX_HELD_SHARE,
) -> list[str]:
    """The nodes to steer new claims off now, in the order chosen. ``nodes``: the group's
    nodes that serve claims now; ``total_gpus``: every GPU of the cluster (booting nodes
    too), which the bound is a share of; ``steered``: the nodes steered before this pass."""
    limit = steering_limit(total_gpus, share)
    before = set(steered)
    ranked = sorted(
        (NodeCandidate(n) for n in nodes if may_steer(n, max_held_share)),
        key=lambda c: (c.node.name not in before, c.score),
    )
    chosen: list[GroupNode] = []
    for candidate in ranked:
        node = candidate.node
        if sum(n.gpus for n in chosen) + node.gpus > limit:
            continue  # a smaller node further down may still fit under the bound
        taken = {n.name for n in chosen} | {node.name}
        room = sum(n.free for n in nodes if n.name not in taken)
        if room + _EPSILON >= sum(n.held for n in chosen) + node.held:
            chosen.append(node)
    return [n.name for n in chosen]


def release_for(
    fits_on: Iterable[str], steered: Sequence[str], nodes: Sequence[GroupNode]
) -> str | None:
    """The steered node to release for a claim that fits on ``fits_on`` now: None when it
    fits on a node not steered (it goes there); otherwise the steered node it fits on that is
    furthest from empty (the worst score), so the nodes closest to removal stay steered."""
    fits = set(fits_on)
    steered_set = set(steered)
    if not fits or fits - steered_set:
        return None
    by_name = {n.name: n for n in nodes}
    options = [NodeCandidate(by_name[name]) for name in steered if name in fits and name in by_name]
    if not options:
        # Steered, but not among the nodes described: release the first it fits on.
        return next(name for name in steered if name in fits)
    return max(options, key=lambda c: c.score).node.name
