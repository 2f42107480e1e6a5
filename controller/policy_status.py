"""The controller's share of GpuNodePolicy status: ``matchedNodes`` and the ``Conflict``
condition. Each node's plugin writes its own ``status.nodes`` entry; this module never touches
that map, and writes only when its part changed, so plugins and controller do not race on the
object's resourceVersion for nothing.

A conflict is two or more policies selecting one node with the same top priority
(``select_policy``); each of them gets ``Conflict=True`` naming the nodes, until the tie is
resolved.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from kubernetes import client

from flexgpu.controller.records import NodeRecord
from flexgpu.driver import node_policy
from flexgpu.driver.names import CRD_GROUP
from flexgpu.driver.node_policy import (
    ConditionStatus,
    GpuNodePolicy,
    NodePolicyError,
    parse_node_policy,
    select_policy,
    set_condition,
)

log = logging.getLogger(__name__)

CONFLICT_CONDITION: Final = "Conflict"
NO_CONFLICT_REASON: Final = "NoConflict"
_NODES_NAMED: Final = 5


@dataclass(frozen=True)
class PolicyStatusPatch:
    name: str
    body: dict[str, Any]  # merge patch for the status subresource


def _conflict_message(choice_message: str, nodes: list[str]) -> str:
    if len(nodes) <= 1:
        return choice_message
    rest = nodes[1:]
    more = ", ".join(rest[:_NODES_NAMED])
    if len(rest) > _NODES_NAMED:
        more += f" and {len(rest) - _NODES_NAMED} more"
    return f"{choice_message}; the same holds on {more}"


def desired_patches(
    raw_policies: Mapping[str, Mapping[str, Any]],
    nodes: Mapping[str, NodeRecord],
    now: datetime,
) -> list[PolicyStatusPatch]:
    """Status patches for the policies whose controller-owned status is not what it should be."""
    policies: list[GpuNodePolicy] = []
    for name, raw in sorted(raw_policies.items()):
        try:
            policies.append(parse_node_policy(raw))
        except NodePolicyError as err:
            log.warning("GpuNodePolicy %s is not valid, status left alone: %s", name, err)
    matched: dict[str, list[str]] = {p.name: [] for p in policies}
    conflicts: dict[str, list[str]] = {p.name: [] for p in policies}
    messages: dict[str, str] = {}
    for node_name, node in sorted(nodes.items()):
        choice = select_policy(policies, node.model.labels)
        for policy in choice.matching:
            matched[policy.name].append(node_name)
        for policy in choice.conflict:
            conflicts[policy.name].append(node_name)
            messages.setdefault(policy.name, choice.conflict_message(node_name))
    patches = []
    for policy in policies:
        status = policy.status
        current_conditions = list(status.conditions) if status else []
        tied = conflicts[policy.name]
        if tied:
            message = _conflict_message(messages[policy.name], tied)
            conditions = set_condition(
                current_conditions,
                CONFLICT_CONDITION,
                status=ConditionStatus.TRUE,
                reason=node_policy.PolicyReason.CONFLICT.value,
                message=message,
                now=now,
                observed_generation=policy.metadata.generation,
            )
        else:
            conditions = set_condition(
                current_conditions,
                CONFLICT_CONDITION,
                status=ConditionStatus.FALSE,
                reason=NO_CONFLICT_REASON,
                message="no other policy selects its nodes with the same priority",
                now=now,
                observed_generation=policy.metadata.generation,
            )
        want_conditions = [c.model_dump(mode="json", exclude_none=True) for c in conditions]
        have_conditions = [c.model_dump(mode="json", exclude_none=True) for c in current_conditions]
        have_matched = list(status.matchedNodes) if status else []
        if want_conditions == have_conditions and matched[policy.name] == have_matched:
            continue
        body = {"status": {"matchedNodes": matched[policy.name], "conditions": want_conditions}}
        patches.append(PolicyStatusPatch(policy.name, body))
    return patches


def apply_patches(api: client.ApiClient, patches: list[PolicyStatusPatch]) -> int:
    """Writes the patches; returns how many were written (a policy deleted meanwhile is not
    an error)."""
    objects = client.CustomObjectsApi(api)
    written = 0
    for patch in patches:
        try:
            objects.patch_cluster_custom_object_status(
                CRD_GROUP, node_policy.VERSION, node_policy.PLURAL, patch.name, patch.body
            )
            written += 1
        except client.ApiException as err:
            if err.status != 404:
                raise
    return written
