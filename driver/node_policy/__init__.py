"""``GpuNodePolicy`` (``flexgpu.dev/v1alpha1``, cluster-scoped): how the GPUs of the nodes it
selects are offered (whole, shared, static MIG layout or dynamic MIG), their default sharing and
the Xids the health monitor ignores; and the pure logic the kubelet plugin and the controller
run on it.

One module per concern; import from this package, not from the modules:

============  ==================================================================
``model``     names (``VERSION``, ``KIND``, ``PLURAL``, ...), pydantic models, field rules
``parsing``   ``parse_node_policy`` and its problem texts (``NodePolicyError``)
``selection`` which policy applies to a node (``select_policy``), and per GPU (``gpu_modes``)
``status``    conditions, per-GPU status entries, merge patches of ``status.nodes``
============  ==================================================================

Whether a MIG layout fits a GPU is ``driver.mig_layout``'s job; its names are re-exported here
for the policy's users.
"""

from __future__ import annotations

from flexgpu.driver.mig_layout import (
    LayoutError,
    LayoutProblem,
    MigPlacementPlan,
    layout_of,
    show_layout,
    validate_layout,
)
from flexgpu.driver.node_policy.model import (
    API_VERSION,
    APPLIED_CONDITION,
    CRD_NAME,
    INT32_MAX,
    INT32_MIN,
    KIND,
    LIST_KIND,
    MAX_EXPRESSIONS,
    MAX_GPU_ENTRIES,
    MAX_INDICES,
    MAX_MIG_COUNT,
    MAX_VALUES,
    MAX_XIDS,
    MIG_PROFILE_NAME,
    PLURAL,
    SHORT_NAME,
    SINGULAR,
    VERSION,
    Condition,
    ConditionStatus,
    ExistingMigDevices,
    GpuMode,
    GpuNodePolicy,
    GpuNodePolicySpec,
    GpuNodePolicyStatus,
    GpuSelection,
    GpuSelector,
    GpuStatus,
    HealthSpec,
    LabelSelector,
    LabelSelectorRequirement,
    NodeStatus,
    PolicyMetadata,
    PolicyReason,
    SelectorOperator,
)
from flexgpu.driver.node_policy.parsing import NodePolicyError, PolicyProblem, parse_node_policy
from flexgpu.driver.node_policy.selection import GpuModeSpec, PolicyChoice, gpu_modes, select_policy
from flexgpu.driver.node_policy.status import (
    format_time,
    gpu_status,
    merge_patch,
    node_condition,
    node_status_patch,
    node_status_removal,
    set_condition,
)
from flexgpu.driver.validation_messages import MAX_PROBLEMS

__all__ = [
    "API_VERSION",
    "APPLIED_CONDITION",
    "CRD_NAME",
    "INT32_MAX",
    "INT32_MIN",
    "KIND",
    "LIST_KIND",
    "MAX_EXPRESSIONS",
    "MAX_GPU_ENTRIES",
    "MAX_INDICES",
    "MAX_MIG_COUNT",
    "MAX_PROBLEMS",
    "MAX_VALUES",
    "MAX_XIDS",
    "MIG_PROFILE_NAME",
    "PLURAL",
    "SHORT_NAME",
    "SINGULAR",
    "VERSION",
    "Condition",
    "ConditionStatus",
    "ExistingMigDevices",
    "GpuMode",
    "GpuModeSpec",
    "GpuNodePolicy",
    "GpuNodePolicySpec",
    "GpuNodePolicyStatus",
    "GpuSelection",
    "GpuSelector",
    "GpuStatus",
    "HealthSpec",
    "LabelSelector",
    "LabelSelectorRequirement",
    "LayoutError",
    "LayoutProblem",
    "MigPlacementPlan",
    "NodePolicyError",
    "NodeStatus",
    "PolicyChoice",
    "PolicyMetadata",
    "PolicyProblem",
    "PolicyReason",
    "SelectorOperator",
    "format_time",
    "gpu_modes",
    "gpu_status",
    "layout_of",
    "merge_patch",
    "node_condition",
    "node_status_patch",
    "node_status_removal",
    "parse_node_policy",
    "select_policy",
    "set_condition",
    "show_layout",
    "validate_layout",
]
