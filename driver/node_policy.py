"""``GpuNodePolicy`` (``flexgpu.dev/v1alpha1``, cluster-scoped): how the GPUs of the nodes it
selects are offered (whole, shared, static MIG layout or dynamic MIG), their default sharing and
the Xids the health monitor ignores; and the pure logic the kubelet plugin and the controller
run on it.

The pydantic models are the source of truth: ``tools/gen_crds.py`` renders the CRD's
openAPIV3Schema from them into ``crds/flexgpu.dev_gpunodepolicies.yaml``.

``parse_node_policy`` is the one entry point for objects read from the API or a manifest (the
admission webhook and the plugin both call it); it raises nothing but ``NodePolicyError``.
Problem texts name the field by its JSON path, the rejected value and what is allowed::

    spec.gpus[0].mode: "Mig" is not allowed; allowed: Whole, Shared, MIG, DynamicMIG
    spec.gpus[1].migLayout: not allowed with mode Whole; allowed: only with mode MIG
    spec.gpus[0].selector: productName and indices together are not allowed; allowed: exactly
        one of productName, indices, all: true

Choosing a policy (``select_policy``): of the policies whose ``nodeSelector`` matches the node
(and that are not being deleted), the one with the highest ``priority`` wins. Two or more at the
top priority are a conflict: no policy wins and the plugin changes nothing on its GPUs; it
keeps what it applied last (or, on a first start, its command-line defaults, which never
destroy MIG devices) and reports reason ``Conflict`` on each tied policy until an admin
resolves the tie. Picking one of them (by name, say) would reconfigure GPUs, and maybe destroy
MIG devices, on a choice the admin never made.

Status (``status.nodes`` is a map so that each node's plugin merge-patches only its own entry,
see ``node_status_patch``)::

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

import fnmatch
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Final, Literal, TypeAlias

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    WithJsonSchema,
    model_validator,
)

from driver.gpu_model import GpuInfo
from driver.mig_layout import (
    LayoutError,
    LayoutProblem,
    MigPlacementPlan,
    layout_of,
    show_layout,
    validate_layout,
)
from driver.names import CRD_GROUP
from driver.opaque_config import SHARING_ALLOWED, SHARING_KEYS_ALLOWED, GpuSharing
from driver.validation_messages import (
    MAX_PROBLEMS,
    MessageRules,
    Pattern,
    Problem,
    ProblemsError,
    StrictModel,
    conflict,
    nested,
    only_str,
    plain_copy,
    translate,
    value_detail,
    value_error,
)

__all__ = [
    "API_VERSION",
    "KIND",
    "MAX_PROBLEMS",
    "PLURAL",
    "SHORT_NAME",
    "Condition",
    "ConditionStatus",
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
    "PolicyProblem",
    "PolicyReason",
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

VERSION: Final = "v1alpha1"
API_VERSION: Final = f"{CRD_GROUP}/{VERSION}"
KIND: Final = "GpuNodePolicy"
LIST_KIND: Final = "GpuNodePolicyList"
PLURAL: Final = "gpunodepolicies"
SINGULAR: Final = "gpunodepolicy"
SHORT_NAME: Final = "gnp"
CRD_NAME: Final = f"{PLURAL}.{CRD_GROUP}"

# Node condition type each plugin keeps in status.nodes[<node>].conditions.
APPLIED_CONDITION: Final = "Applied"
INT32_MIN: Final = -(2**31)
INT32_MAX: Final = 2**31 - 1
# Bounds that keep the apiserver's CEL cost estimate finite; far above any real policy.
MAX_GPU_ENTRIES: Final = 64
MAX_INDICES: Final = 64
MAX_EXPRESSIONS: Final = 64
MAX_VALUES: Final = 256
MAX_XIDS: Final = 256
MAX_MIG_COUNT: Final = 64


class GpuMode(StrEnum):
    """How a GPU is offered."""

    WHOLE = "Whole"  # gpu-<i>, one claim at a time (its sharing settings apply inside)
    SHARED = "Shared"  # fractions of the GPU through consumable capacity (memory, compute)
    MIG = "MIG"  # MIG on, a fixed set of instances (migLayout) published as devices
    DYNAMIC_MIG = "DynamicMIG"  # MIG on, instances created per claim at any free placement


class PolicyReason(StrEnum):
    """Reasons in ``status.nodes[*].gpus[*].reason`` and the nodes' ``Applied`` condition."""

    APPLIED = "Applied"  # the GPU is in the mode (and layout) the policy asks for
    PENDING = "Pending"  # not yet: e.g. devices are in use; the plugin retries
    UNSUPPORTED = "Unsupported"  # the GPU cannot do it (no MIG, profile not offered)
    INVALID_LAYOUT = "InvalidLayout"  # the migLayout does not fit the GPU
    CONFLICT = "Conflict"  # another policy matches the node with the same priority


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class SelectorOperator(StrEnum):
    IN = "In"
    NOT_IN = "NotIn"
    EXISTS = "Exists"
    DOES_NOT_EXIST = "DoesNotExist"


# --------------------------------------------------------------------------- field types


_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


def _label_key(key: str) -> str:
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN.fullmatch(prefix)):
        raise value_error("prefix is not a DNS subdomain")
    if not name or len(name) > 63 or not _LABEL_NAME.fullmatch(name):
        raise value_error("not a label name")
    return key


def _label_value(value: str) -> str:
    if value and (len(value) > 63 or not _LABEL_NAME.fullmatch(value)):
        raise value_error("not a label value")
    return value


# NVML names: 1g.10gb, 1g.10gb+me, 1g.23gb+gfx, 1g.45gb-me (Blackwell), 7g.141gb.
MIG_PROFILE_NAME: Final = re.compile(r"[1-9][0-9]?g\.[0-9]{1,4}gb([+-][a-z]{1,8})*")


def _profile_name(name: str) -> str:
    if not MIG_PROFILE_NAME.fullmatch(name):
        raise value_error("")
    return name


def _distinct(values: list[int]) -> list[int]:
    seen: set[int] = set()
    for value in values:
        if value in seen:
            raise value_error(f"{value} twice")
        seen.add(value)
    return values


def _timestamp(value: str) -> str:
    # RFC 3339 as Kubernetes writes metav1.Time: 2025-01-01T00:00:00Z.
    if not re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)", value):
        raise value_error("not an RFC 3339 time")
    try:
        datetime.fromisoformat(value)
    except ValueError:
        raise value_error("not an RFC 3339 time") from None
    return value


Mode: TypeAlias = Annotated[GpuMode, Strict(False), BeforeValidator(only_str)]
Reason: TypeAlias = Annotated[PolicyReason, Strict(False), BeforeValidator(only_str)]
Status: TypeAlias = Annotated[ConditionStatus, Strict(False), BeforeValidator(only_str)]
Operator: TypeAlias = Annotated[SelectorOperator, Strict(False), BeforeValidator(only_str)]
LabelKey: TypeAlias = Annotated[str, AfterValidator(_label_key)]
LabelValue: TypeAlias = Annotated[str, AfterValidator(_label_value)]
ProfileName: TypeAlias = Annotated[str, AfterValidator(_profile_name)]
MigCount: TypeAlias = Annotated[int, Field(ge=1, le=MAX_MIG_COUNT)]
Timestamp: TypeAlias = Annotated[
    str,
    AfterValidator(_timestamp),
    WithJsonSchema({"type": "string", "format": "date-time"}),
]
MigLayout: TypeAlias = dict[ProfileName, MigCount]


# --------------------------------------------------------------------------- models


_VALUES_RULE: Final = (
    "self.operator in ['In', 'NotIn'] ? (has(self.values) && size(self.values) > 0) "
    ": (!has(self.values) || size(self.values) == 0)"
)


class LabelSelectorRequirement(StrictModel):
    """A label selector requirement, as in Kubernetes' metav1.LabelSelector."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": _VALUES_RULE,
                    "message": "values must be non-empty with operators In and NotIn, and empty "
                    "with Exists and DoesNotExist",
                }
            ]
        }
    )

    key: LabelKey = Field(description="The label key the selector applies to")
    operator: Operator = Field(description="In, NotIn, Exists or DoesNotExist")
    values: list[LabelValue] | None = Field(
        default=None,
        max_length=MAX_VALUES,
        description="Label values: non-empty with In and NotIn, empty with Exists and DoesNotExist",
    )

    @model_validator(mode="after")
    def _values_match_operator(self) -> LabelSelectorRequirement:
        listed = bool(self.values)
        wants = self.operator in (SelectorOperator.IN, SelectorOperator.NOT_IN)
        allowed = "a non-empty list with operators In and NotIn, none with Exists and DoesNotExist"
        if wants and not listed:
            raise conflict("values", f"missing with operator {self.operator.value}", allowed)
        if listed and not wants:
            raise conflict("values", f"not allowed with operator {self.operator.value}", allowed)
        return self

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        if self.operator is SelectorOperator.EXISTS:
            return present
        if self.operator is SelectorOperator.DOES_NOT_EXIST:
            return not present
        inside = present and labels[self.key] in (self.values or ())
        return inside if self.operator is SelectorOperator.IN else not inside


class LabelSelector(StrictModel):
    """Which nodes the policy covers. All requirements must hold; an empty selector selects
    every node."""

    matchLabels: dict[LabelKey, LabelValue] | None = Field(
        default=None, description="Labels a node must have, with these values"
    )
    matchExpressions: list[LabelSelectorRequirement] | None = Field(
        default=None, max_length=MAX_EXPRESSIONS, description="Requirements a node must meet"
    )

    def matches(self, labels: Mapping[str, str]) -> bool:
        for key, value in (self.matchLabels or {}).items():
            if labels.get(key) != value:
                return False
        return all(expression.matches(labels) for expression in self.matchExpressions or ())


_ONE_SELECTOR: Final = "exactly one of productName, indices, all: true"


class GpuSelector(StrictModel):
    """Which GPUs of a node an entry covers: exactly one of productName, indices, all."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "(has(self.productName) ? 1 : 0) + (has(self.indices) ? 1 : 0) "
                    "+ (has(self.all) ? 1 : 0) == 1",
                    "message": "set exactly one of productName, indices, all",
                }
            ]
        }
    )

    productName: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description='GPU product name as NVML reports it, exact or a glob: "NVIDIA H100*"',
    )
    indices: (
        Annotated[list[Annotated[int, Field(ge=0, le=1023)]], AfterValidator(_distinct)] | None
    ) = Field(
        default=None,
        min_length=1,
        max_length=MAX_INDICES,
        description="GPU indices on the node",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    all: Literal[True] | None = Field(default=None, description="Every GPU of the node")

    @model_validator(mode="after")
    def _exactly_one(self) -> GpuSelector:
        given = [
            name
            for name, value in (
                ("productName", self.productName),
                ("indices", self.indices),
                ("all", self.all),
            )
            if value is not None
        ]
        if not given:
            raise conflict("", "empty is not allowed", _ONE_SELECTOR)
        if len(given) > 1:
            both = " and ".join(given) if len(given) == 2 else "productName, indices and all"
            raise conflict("", f"{both} together are not allowed", _ONE_SELECTOR)
        return self

    def selects(self, gpu: GpuInfo) -> bool:
        if self.all:
            return True
        if self.indices is not None:
            return gpu.index in self.indices
        assert self.productName is not None
        return fnmatch.fnmatchcase(gpu.product_name, self.productName)


_LAYOUT_ALLOWED: Final = 'a map of MIG profile name to count, e.g. {"1g.10gb": 7}'


class GpuSelection(StrictModel):
    """A mode for the GPUs the selector picks. Later entries override earlier ones."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.mode == 'MIG' ? has(self.migLayout) : !has(self.migLayout)",
                    "message": "migLayout is required with mode MIG and not allowed with other "
                    "modes",
                }
            ]
        }
    )

    selector: GpuSelector = Field(description="Which GPUs of the node this entry covers")
    mode: Mode = Field(description="Whole, Shared, MIG or DynamicMIG")
    migLayout: MigLayout | None = Field(
        default=None,
        description="With mode MIG: MIG instances to create, profile name to count, e.g. "
        '{"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2}',
    )

    @model_validator(mode="after")
    def _layout_with_mig(self) -> GpuSelection:
        if self.mode is GpuMode.MIG and self.migLayout is None:
            raise conflict("migLayout", "missing", f"required with mode MIG, {_LAYOUT_ALLOWED}")
        if self.mode is not GpuMode.MIG and self.migLayout is not None:
            raise conflict(
                "migLayout", f"not allowed with mode {self.mode.value}", "only with mode MIG"
            )
        return self


class HealthSpec(StrictModel):
    """Health monitoring of the covered nodes' GPUs."""

    ignoredXids: (
        Annotated[list[Annotated[int, Field(ge=1, le=INT32_MAX)]], AfterValidator(_distinct)] | None
    ) = Field(
        default=None,
        max_length=MAX_XIDS,
        description="Xid errors that do not mark a GPU unhealthy, on top of the built-in ones",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )


class GpuNodePolicySpec(StrictModel):
    """How the GPUs of the selected nodes are offered."""

    nodeSelector: LabelSelector = Field(
        default_factory=LabelSelector,
        description="Nodes this policy covers; empty selects every node",
    )
    priority: int = Field(
        default=0,
        ge=INT32_MIN,
        le=INT32_MAX,
        description="Of the policies matching a node, the highest priority wins; a tie at the "
        "top is a conflict and none applies",
    )
    gpus: list[GpuSelection] = Field(
        default_factory=list,
        max_length=MAX_GPU_ENTRIES,
        description="Modes by GPU; for a GPU several entries select, the last one wins. GPUs "
        "no entry selects keep the plugin's defaults",
    )
    sharing: GpuSharing | None = Field(
        default=None,
        description="Default sharing of the covered GPUs (a claim's own config overrides it)",
    )
    health: HealthSpec | None = None


class Condition(StrictModel):
    """A standard Kubernetes condition (metav1.Condition)."""

    type: str = Field(min_length=1, max_length=316, pattern=r"^([a-z0-9.-]+/)?[A-Za-z0-9_.-]+$")
    status: Status = Field(description="True, False or Unknown")
    reason: str = Field(
        min_length=1, max_length=1024, pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
    )
    message: str = Field(default="", max_length=32768)
    lastTransitionTime: Timestamp
    observedGeneration: int | None = Field(default=None, ge=0)


class GpuStatus(StrictModel):
    """One GPU of a node under the policy."""

    mode: Mode = Field(description="The mode the policy gives this GPU")
    migLayout: MigLayout | None = Field(
        default=None, description="MIG instances on the GPU now, profile name to count"
    )
    productName: str | None = None
    reason: Reason = Field(description="Applied, Pending, Unsupported, InvalidLayout or Conflict")
    message: str = Field(default="", max_length=32768)


class NodeStatus(StrictModel):
    """What one node's plugin made of the policy."""

    observedGeneration: int | None = Field(
        default=None, ge=0, description="The policy generation the plugin acted on"
    )
    gpus: dict[str, GpuStatus] = Field(
        default_factory=dict, description='Per GPU, keyed by GPU index ("0", "1", ...)'
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )


class GpuNodePolicyStatus(StrictModel):
    """Written by the controller (conditions, matchedNodes) and by each node's plugin
    (its own entry of nodes)."""

    observedGeneration: int | None = Field(default=None, ge=0)
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    matchedNodes: list[str] = Field(
        default_factory=list,
        description="Nodes the nodeSelector matches",
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )
    nodes: dict[str, NodeStatus] = Field(
        default_factory=dict, description="Per node, keyed by node name"
    )


class PolicyMetadata(BaseModel):
    """The parts of ObjectMeta the policy logic reads; the rest is ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    name: str = Field(min_length=1)
    generation: int | None = None
    resourceVersion: str | None = None
    uid: str | None = None
    deletionTimestamp: str | None = None


class GpuNodePolicy(StrictModel):
    """Per-node GPU configuration (cluster-scoped)."""

    apiVersion: Literal["flexgpu.dev/v1alpha1"] = "flexgpu.dev/v1alpha1"
    kind: Literal["GpuNodePolicy"] = "GpuNodePolicy"
    metadata: PolicyMetadata
    spec: GpuNodePolicySpec
    status: GpuNodePolicyStatus | None = None

    @property
    def name(self) -> str:
        return self.metadata.name


# --------------------------------------------------------------------------- errors


@dataclass(frozen=True)
class PolicyProblem(Problem):
    """One reason an object is not a valid policy: ``path`` holds field names, list indices
    and map keys from the object's root; ``detail`` is the text after the path."""


class NodePolicyError(ProblemsError[PolicyProblem]):
    """The object is not a valid GpuNodePolicy. ``problems`` holds one text per problem (at
    most ``MAX_PROBLEMS``, then a count of the rest); ``details`` the same, structured."""


# --------------------------------------------------------------------------- parsing

_ROOT_ALLOWED: Final = f"a {KIND} object with apiVersion {API_VERSION}"
_LABEL_KEY_ALLOWED: Final = (
    'a label key: an optional DNS subdomain prefix and "/", then up to 63 letters, digits, '
    '"-", "_" or "." starting and ending with a letter or digit'
)
_LABEL_VALUE_ALLOWED: Final = (
    'a label value: empty, or up to 63 letters, digits, "-", "_" or "." starting and ending '
    "with a letter or digit"
)
_PROFILE_ALLOWED: Final = 'a MIG profile name such as "1g.10gb", "1g.10gb+me" or "3g.40gb"'
_COUNT_ALLOWED: Final = f"an integer from 1 to {MAX_MIG_COUNT}"
_CONDITION: Final = {
    ("type",): "a condition type such as Applied",
    ("status",): ", ".join(ConditionStatus),
    ("reason",): "a CamelCase reason such as Applied",
    ("message",): "a string of at most 32768 characters",
    ("lastTransitionTime",): 'an RFC 3339 time, e.g. "2025-01-01T00:00:00Z"',
    ("observedGeneration",): "an integer from 0",
}


def _condition_paths(prefix: tuple[str, ...]) -> dict[Pattern, str]:
    return {(*prefix, "*", *key): text for key, text in _CONDITION.items()}


_NODE: Final = ("status", "nodes", "*")
_ALLOWED: Final[dict[Pattern, str]] = {
    ("apiVersion",): API_VERSION,
    ("kind",): KIND,
    ("metadata",): "an object with the policy's name",
    ("metadata", "name"): "the policy's name, a non-empty string",
    ("spec", "nodeSelector", "matchLabels"): 'an object of label key to value, e.g. {"a": "b"}',
    ("spec", "nodeSelector", "matchLabels", "*"): _LABEL_VALUE_ALLOWED,
    ("spec", "nodeSelector", "matchExpressions"): (
        f"a list of at most {MAX_EXPRESSIONS} requirements with key, operator and values"
    ),
    ("spec", "nodeSelector", "matchExpressions", "*", "key"): _LABEL_KEY_ALLOWED,
    ("spec", "nodeSelector", "matchExpressions", "*", "operator"): ", ".join(SelectorOperator),
    ("spec", "nodeSelector", "matchExpressions", "*", "values"): (
        f"a list of at most {MAX_VALUES} label values"
    ),
    ("spec", "nodeSelector", "matchExpressions", "*", "values", "*"): _LABEL_VALUE_ALLOWED,
    ("spec", "priority"): f"an integer from {INT32_MIN} to {INT32_MAX}",
    ("spec", "gpus"): f"a list of at most {MAX_GPU_ENTRIES} entries with selector and mode",
    ("spec", "gpus", "*", "mode"): ", ".join(GpuMode),
    ("spec", "gpus", "*", "selector", "productName"): (
        'a GPU product name, exact or a glob, e.g. "NVIDIA H100*"'
    ),
    ("spec", "gpus", "*", "selector", "indices"): (
        f"a non-empty list of at most {MAX_INDICES} distinct GPU indices"
    ),
    ("spec", "gpus", "*", "selector", "indices", "*"): "a GPU index, an integer from 0 to 1023",
    ("spec", "gpus", "*", "selector", "all"): "true",
    ("spec", "gpus", "*", "migLayout"): _LAYOUT_ALLOWED,
    ("spec", "gpus", "*", "migLayout", "*"): _COUNT_ALLOWED,
    ("spec", "health", "ignoredXids"): f"a list of at most {MAX_XIDS} distinct Xids",
    ("spec", "health", "ignoredXids", "*"): f"an Xid, an integer from 1 to {INT32_MAX}",
    ("status", "observedGeneration"): "an integer from 0",
    ("status", "matchedNodes"): "a list of distinct node names",
    ("status", "matchedNodes", "*"): "a node name",
    ("status", "nodes"): "an object of node name to node status",
    (*_NODE, "observedGeneration"): "an integer from 0",
    (*_NODE, "gpus"): 'an object of GPU index to GPU status, e.g. {"0": {...}}',
    (*_NODE, "gpus", "*", "mode"): ", ".join(GpuMode),
    (*_NODE, "gpus", "*", "migLayout"): _LAYOUT_ALLOWED,
    (*_NODE, "gpus", "*", "migLayout", "*"): _COUNT_ALLOWED,
    (*_NODE, "gpus", "*", "productName"): "a string",
    (*_NODE, "gpus", "*", "reason"): ", ".join(PolicyReason),
    (*_NODE, "gpus", "*", "message"): "a string of at most 32768 characters",
    **_condition_paths(("status", "conditions")),
    **_condition_paths((*_NODE, "conditions")),
    # spec.sharing is the opaque config's GpuSharing: same texts.
    **nested(("spec", "sharing"), SHARING_ALLOWED),
}
# What a map's keys allow, by the map's path.
_KEYS_ALLOWED: Final[dict[Pattern, str]] = {
    ("spec", "nodeSelector", "matchLabels"): _LABEL_KEY_ALLOWED,
    ("spec", "gpus", "*", "migLayout"): _PROFILE_ALLOWED,
    (*_NODE, "gpus", "*", "migLayout"): _PROFILE_ALLOWED,
    **nested(("spec", "sharing"), SHARING_KEYS_ALLOWED),
}
_RULES: Final = MessageRules(
    model=GpuNodePolicy,
    allowed=_ALLOWED,
    fallback=f"see the {KIND} CRD schema",
    keys_allowed=_KEYS_ALLOWED,
)


def parse_node_policy(obj: Mapping[str, Any]) -> GpuNodePolicy:
    """Validate a GpuNodePolicy object (decoded JSON, as the API returns it or a manifest holds
    it) into the model. Raises ``NodePolicyError`` listing every problem, and nothing else."""
    data = plain_copy(obj)
    if not isinstance(data, dict):
        raise NodePolicyError([PolicyProblem((), value_detail(data, _ROOT_ALLOWED))])
    problems: list[PolicyProblem] = []
    if "apiVersion" not in data:
        problems.append(PolicyProblem(("apiVersion",), f"missing; allowed: {API_VERSION}"))
    if "kind" not in data:
        problems.append(PolicyProblem(("kind",), f"missing; allowed: {KIND}"))
    try:
        policy = GpuNodePolicy.model_validate(data)
    except ValidationError as error:
        problems += [translate(_RULES, entry, PolicyProblem) for entry in error.errors()]
    if problems:
        raise NodePolicyError(problems)
    return policy


# --------------------------------------------------------------------------- choosing


@dataclass(frozen=True)
class PolicyChoice:
    """What ``select_policy`` decided for a node.

    ``policy``: the winner, or None. ``conflict``: the policies tied at the top priority (two
    or more; then ``policy`` is None), sorted by name. ``matching``: every policy that selects
    the node, highest priority first, then by name.
    """

    policy: GpuNodePolicy | None
    conflict: tuple[GpuNodePolicy, ...] = ()
    matching: tuple[GpuNodePolicy, ...] = ()

    @property
    def is_conflict(self) -> bool:
        return bool(self.conflict)

    def conflict_message(self, node_name: str) -> str:
        """The condition message for each tied policy; empty without a conflict."""
        if not self.conflict:
            return ""
        names = ", ".join(policy.name for policy in self.conflict)
        priority = self.conflict[0].spec.priority
        return (
            f"policies {names} all select node {node_name} with priority {priority}; none is "
            "applied and the node keeps its current GPU configuration until one has a higher "
            "priority or stops selecting the node"
        )


def select_policy(
    policies: Iterable[GpuNodePolicy], node_labels: Mapping[str, str]
) -> PolicyChoice:
    """The policy that applies to a node with ``node_labels``: the matching one with the
    highest priority. Policies being deleted do not count. See the module docstring for ties."""
    matching = sorted(
        (
            policy
            for policy in policies
            if policy.metadata.deletionTimestamp is None
            and policy.spec.nodeSelector.matches(node_labels)
        ),
        key=lambda policy: (-policy.spec.priority, policy.name),
    )
    if not matching:
        return PolicyChoice(None)
    top = [p for p in matching if p.spec.priority == matching[0].spec.priority]
    if len(top) > 1:
        return PolicyChoice(None, tuple(top), tuple(matching))
    return PolicyChoice(top[0], (), tuple(matching))


@dataclass(frozen=True)
class GpuModeSpec:
    """What a policy asks of one GPU. ``entry`` is the position in ``spec.gpus`` of the entry
    that decided it (for messages: ``spec.gpus[2]``)."""

    mode: GpuMode
    entry: int
    mig_layout: Mapping[str, int] | None = None
    sharing: GpuSharing | None = None
    ignored_xids: tuple[int, ...] = field(default=())


def gpu_modes(policy: GpuNodePolicy, gpus: Sequence[GpuInfo]) -> dict[int, GpuModeSpec]:
    """GPU index -> what the policy asks of it; for a GPU several entries select, the last
    one wins. GPUs no entry selects are left out: they keep the plugin's defaults."""
    spec = policy.spec
    xids = tuple(sorted(spec.health.ignoredXids or ())) if spec.health else ()
    out: dict[int, GpuModeSpec] = {}
    for position, entry in enumerate(spec.gpus):
        for gpu in gpus:
            if entry.selector.selects(gpu):
                out[gpu.index] = GpuModeSpec(
                    mode=entry.mode,
                    entry=position,
                    mig_layout=dict(entry.migLayout) if entry.migLayout is not None else None,
                    sharing=spec.sharing,
                    ignored_xids=xids,
                )
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------- status


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
