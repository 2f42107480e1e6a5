"""The label that names the node a ResourceClaim's flexgpu devices are allocated on, so that a
node watches only its own claims.

ResourceClaims offer no field selector beyond ``metadata.name`` and ``metadata.namespace``
(Kubernetes 1.37, pkg/registry/resource/resourceclaim/strategy.go), so a node that must see
claims before its kubelet calls prepare (binding conditions) would otherwise watch every claim
of the cluster. The controller's leader sets this label where it first sees the allocation;
each node watches with a label selector on its own value. A label value is at most 63
characters and a node name may be up to 253, so a name that is not a valid label value is
replaced by a digest of it (both sides compute it here). Whether the nodes may rely on the
label is told by the controller's Lease (``labels_live``): while the controller is down, or
of a version that does not label, the nodes watch every claim as before. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, Final

from flexgpu.driver.names import DRIVER_NAME

__all__ = [
    "CLAIM_NODE_LABEL",
    "LABELS_LIVE_ANNOTATION",
    "allocated_node",
    "label_patch",
    "labels_live",
    "node_label_value",
    "node_selector",
]

CLAIM_NODE_LABEL: Final = f"{DRIVER_NAME}/node"
# On the controller's Lease: the identity of the leader that has labelled every allocated
# claim it found when it took the lease. Equal to the holder: the nodes may rely on labels.
LABELS_LIVE_ANNOTATION: Final = f"{DRIVER_NAME}/claim-node-labels"
# A lease renewed this long after its duration ended still counts: node clocks may differ.
CLOCK_SKEW_S: Final = 15.0

_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_MAX_LABEL_VALUE = 63


def node_label_value(node_name: str) -> str:
    """The label value for ``node_name``: the name itself when it is a valid label value,
    otherwise ``sha256-`` and the first 56 hex digits of its digest (63 characters)."""
    if not node_name:
        raise ValueError("node name: empty; a node name is a non-empty DNS subdomain")
    if len(node_name) <= _MAX_LABEL_VALUE and _LABEL_VALUE.match(node_name):
        return node_name
    return "sha256-" + hashlib.sha256(node_name.encode()).hexdigest()[:56]


def node_selector(node_name: str) -> str:
    """The ``labelSelector`` that finds the claims allocated on ``node_name``."""
    return f"{CLAIM_NODE_LABEL}={node_label_value(node_name)}"


def allocated_node(claim: Mapping[str, Any]) -> str | None:
    """The node (pool name: a node's pool is named after it) of the claim's flexgpu devices,
    None when none is allocated. Node-local devices put one claim on one node; should results
    name several pools, the first in order is taken (the others' nodes fall back to reading
    the claim in prepare)."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    pools = sorted(
        str(r.get("pool"))
        for r in results
        if isinstance(r, Mapping) and r.get("driver") == DRIVER_NAME and r.get("pool")
    )
    return pools[0] if pools else None


def label_patch(claim: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch that makes the claim's label match its allocation (set, changed, or
    removed once deallocated), None when it already does. It carries the claim's UID, which
    the API server checks: a claim deleted and created again under the name is not touched."""
    meta = claim.get("metadata") or {}
    node = allocated_node(claim)
    wanted = node_label_value(node) if node else None
    if (meta.get("labels") or {}).get(CLAIM_NODE_LABEL) == wanted:
        return None
    return {"metadata": {"uid": meta.get("uid"), "labels": {CLAIM_NODE_LABEL: wanted}}}


def labels_live(lease: Mapping[str, Any] | None, now: datetime | None = None) -> bool:
    """Whether the controller's Lease says claims are labelled: held, renewed within its
    duration (plus ``CLOCK_SKEW_S``), and marked by its holder once that holder labelled
    every claim allocated before it took over."""
    if not lease:
        return False
    spec = lease.get("spec") or {}
    holder = spec.get("holderIdentity")
    annotations = (lease.get("metadata") or {}).get("annotations") or {}
    if not holder or annotations.get(LABELS_LIVE_ANNOTATION) != holder:
        return False
    try:
        renewed = datetime.fromisoformat(str(spec.get("renewTime")).replace("Z", "+00:00"))
        duration = float(spec.get("leaseDurationSeconds") or 0)
    except (TypeError, ValueError):
        return False
    if renewed.tzinfo is None:
        renewed = renewed.replace(tzinfo=UTC)
    age = ((now or datetime.now(UTC)) - renewed).total_seconds()
    return age <= duration + CLOCK_SKEW_S
