"""The ``GpuNodePolicy`` resource (``flexgpu.dev/v1alpha1``, cluster-scoped): its names, its
pydantic models and their field rules.

The models are the source of truth for the CRD: ``tools/gen_crds.py`` renders its
openAPIV3Schema from them into ``crds/flexgpu.dev_gpunodepolicies.yaml``. Rules the apiserver
must enforce too are written twice, as model validators and as CEL
(``x-kubernetes-validations``); a unit test evaluates the CEL against the same samples.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Final, Literal, TypeAlias

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    WithJsonSchema,
    model_validator,
)

from flexgpu.driver.gpu_model import GpuInfo
from flexgpu.driver.names import CRD_GROUP
from flexgpu.driver.opaque_config import GpuSharing
from flexgpu.driver.validation_messages import StrictModel, conflict, only_str, value_error

# The one place the served version is written; everything else derives from it.
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


class ExistingMigDevices(StrEnum):
    """What a policy may do with MIG devices on a GPU that flexgpu did not create."""

    KEEP = "Keep"  # never destroyed: a change that would destroy them waits for the admin
    REPLACE = "Replace"  # destroyed like flexgpu's own once no claim uses the GPU


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
Existing: TypeAlias = Annotated[ExistingMigDevices, Strict(False), BeforeValidator(only_str)]
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


LAYOUT_ALLOWED: Final = 'a map of MIG profile name to count, e.g. {"1g.10gb": 7}'


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
    existingMigDevices: Existing = Field(
        default=ExistingMigDevices.KEEP,
        description="MIG devices on these GPUs that flexgpu did not create (made by "
        "nvidia-mig-parted, the GPU operator or by hand): Keep (default) never destroys them, "
        "so a change that would is left Pending; Replace destroys them once no claim uses the "
        "GPU",
    )

    @model_validator(mode="after")
    def _layout_with_mig(self) -> GpuSelection:
        if self.mode is GpuMode.MIG and self.migLayout is None:
            raise conflict("migLayout", "missing", f"required with mode MIG, {LAYOUT_ALLOWED}")
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

    # Literal[...] takes no constants: these equal API_VERSION and KIND (a unit test checks).
    apiVersion: Literal["flexgpu.dev/v1alpha1"] = "flexgpu.dev/v1alpha1"
    kind: Literal["GpuNodePolicy"] = "GpuNodePolicy"
    metadata: PolicyMetadata
    spec: GpuNodePolicySpec
    status: GpuNodePolicyStatus | None = None

    @property
    def name(self) -> str:
        return self.metadata.name
