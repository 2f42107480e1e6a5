"""``status`` of a ``GpuNodePolicy``: conditions, per-GPU entries and the merge patches that
write them.

``status.nodes`` is a map so that each node's plugin merge-patches only its own entry (see
``node_status_patch``)::

    status:
      matchedNodes: [node-a, node-b]            # controller
      conditions: [...]                          # controller
      nodes:
        node-a:
          observedGeneration: 3
          gpus:
            "0": {mode: MIG, migLayout: {"1g.10gb": 7}, productName: NVIDIA H100 80GB HBM3,
                  reason: Applied, message: ""}
          conditions:
            - {type: Applied, status: "True", reason: Applied, message: ..., lastTransitionTime:
               "2025-01-01T00:00:00Z", observedGeneration: 3}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Final

from flexgpu.driver.gpu_model import GpuInfo
from flexgpu.driver.node_policy.model import (
    Condition,
    ConditionStatus,
    GpuStatus,
    NodeStatus,
    PolicyReason,
)
from flexgpu.driver.node_policy.selection import GpuModeSpec


def format_time(moment: datetime) -> str:
    """metav1.Time text: UTC, whole seconds, ``Z``."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    *,
    status: ConditionStatus,
    reason: str,
    message: str,
    now: datetime,
    observed_generation: int | None = None,
) -> list[Condition]:
    """``conditions`` with the one of ``type_`` set (as meta.SetStatusCondition does):
    ``lastTransitionTime`` moves to ``now`` only when the status changes."""
    old = next((c for c in conditions if c.type == type_), None)
    since = old.lastTransitionTime if old is not None and old.status is status else None
    new = Condition(
        type=type_,
        status=status,
        reason=reason,
        message=message,
        lastTransitionTime=since or format_time(now),
        observedGeneration=observed_generation,
    )
    if old is None:
        return [*conditions, new]
    return [new if c.type == type_ else c for c in conditions]


# Worst first: the node condition reports the first reason found in this order.
_SEVERITY: Final = (
    PolicyReason.CONFLICT,
    PolicyReason.INVALID_LAYOUT,
    PolicyReason.UNSUPPORTED,
    PolicyReason.PENDING,
)


def node_condition(
    gpus: Mapping[str, GpuStatus], conflict_message: str = ""
) -> tuple[ConditionStatus, PolicyReason, str]:
    """Status, reason and message of a node's ``Applied`` condition from its GPUs' statuses:
    True/Applied when every GPU is applied, else False with the worst reason (Conflict,
    InvalidLayout, Unsupported, Pending) and the messages of the GPUs that have it."""
    if conflict_message:
        return ConditionStatus.FALSE, PolicyReason.CONFLICT, conflict_message
    for reason in _SEVERITY:
        hit = sorted((k for k, g in gpus.items() if g.reason is reason), key=_index_order)
        if hit:
            message = "; ".join(f"GPU {k}: {gpus[k].message or reason.value}" for k in hit)
            return ConditionStatus.FALSE, reason, message
    count = len(gpus)
    noun = "GPU is" if count == 1 else "GPUs are"
    return ConditionStatus.TRUE, PolicyReason.APPLIED, f"{count} {noun} as the policy asks"


def _index_order(key: str) -> tuple[int, str]:
    return (int(key), key) if key.isdigit() else (1 << 30, key)


def gpu_status(
    mode: GpuModeSpec,
    gpu: GpuInfo,
    reason: PolicyReason,
    message: str = "",
    current_layout: Mapping[str, int] | None = None,
) -> GpuStatus:
    """The status entry of one GPU; ``current_layout`` is ``layout_of`` its MIG devices."""
    return GpuStatus(
        mode=mode.mode,
        migLayout=dict(current_layout) if current_layout is not None else None,
        productName=gpu.product_name,
        reason=reason,
        message=message,
    )


def merge_patch(old: object, new: object) -> object:
    """An RFC 7386 JSON merge patch that turns ``old`` into ``new`` (JSON values): keys gone
    from an object become null, lists and scalars are replaced whole."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: dict[str, object] = {}
    for key in old:
        if key not in new:
            patch[key] = None
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_patch(old[key], value) if isinstance(value, dict) else value
    return patch


def node_status_patch(
    node_name: str, new: NodeStatus, old: NodeStatus | None = None
) -> dict[str, Any]:
    """Body of a merge patch (``application/merge-patch+json``) on the status subresource
    that sets this node's entry in ``status.nodes`` and touches no other node's.

    Merge patches merge maps, so keys present on the server but gone from ``new`` (a GPU, a
    MIG profile) must be nulled: pass as ``old`` the entry as last read from the server."""
    new_json = new.model_dump(mode="json", exclude_none=True)
    if old is None:
        body: object = new_json
    else:
        body = merge_patch(old.model_dump(mode="json", exclude_none=True), new_json)
    return {"status": {"nodes": {node_name: body}}}


def node_status_removal(node_name: str) -> dict[str, Any]:
    """Merge patch removing a node's entry (the node no longer follows the policy)."""
    return {"status": {"nodes": {node_name: None}}}
