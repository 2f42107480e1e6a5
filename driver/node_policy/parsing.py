"""Parsing a ``GpuNodePolicy`` read from the API or a manifest, with problem texts.

``parse_node_policy`` is the one entry point for objects read from the API or a manifest (the
admission webhook and the plugin both call it); it raises nothing but ``NodePolicyError``.
Problem texts (see ``driver.validation_messages``) name the field by its JSON path, the
rejected value and what is allowed::

    spec.gpus[0].mode: "Mig" is not allowed; allowed: Whole, Shared, MIG, DynamicMIG
    spec.gpus[1].migLayout: not allowed with mode Whole; allowed: only with mode MIG
    spec.gpus[0].selector: productName and indices together are not allowed; allowed: exactly
        one of productName, indices, all: true
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from pydantic import ValidationError

from flexgpu.driver.node_policy.model import (
    API_VERSION,
    INT32_MAX,
    INT32_MIN,
    KIND,
    LAYOUT_ALLOWED,
    MAX_EXPRESSIONS,
    MAX_GPU_ENTRIES,
    MAX_INDICES,
    MAX_MIG_COUNT,
    MAX_VALUES,
    MAX_XIDS,
    ConditionStatus,
    ExistingMigDevices,
    GpuMode,
    GpuNodePolicy,
    PolicyReason,
    SelectorOperator,
)
from flexgpu.driver.opaque_config import SHARING_ALLOWED, SHARING_KEYS_ALLOWED
from flexgpu.driver.validation_messages import (
    MessageRules,
    Pattern,
    Problem,
    ProblemsError,
    nested,
    plain_copy,
    translate,
    value_detail,
)


@dataclass(frozen=True)
class PolicyProblem(Problem):
    """One reason an object is not a valid policy: ``path`` holds field names, list indices
    and map keys from the object's root; ``detail`` is the text after the path."""


class NodePolicyError(ProblemsError[PolicyProblem]):
    """The object is not a valid GpuNodePolicy. ``problems`` holds one text per problem (at
    most ``MAX_PROBLEMS``, then a count of the rest); ``details`` the same, structured."""


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
    ("spec", "gpus", "*", "migLayout"): LAYOUT_ALLOWED,
    ("spec", "gpus", "*", "migLayout", "*"): _COUNT_ALLOWED,
    ("spec", "gpus", "*", "existingMigDevices"): ", ".join(ExistingMigDevices),
    ("spec", "health", "ignoredXids"): f"a list of at most {MAX_XIDS} distinct Xids",
    ("spec", "health", "ignoredXids", "*"): f"an Xid, an integer from 1 to {INT32_MAX}",
    ("status", "observedGeneration"): "an integer from 0",
    ("status", "matchedNodes"): "a list of distinct node names",
    ("status", "matchedNodes", "*"): "a node name",
    ("status", "nodes"): "an object of node name to node status",
    (*_NODE, "observedGeneration"): "an integer from 0",
    (*_NODE, "gpus"): 'an object of GPU index to GPU status, e.g. {"0": {...}}',
    (*_NODE, "gpus", "*", "mode"): ", ".join(GpuMode),
    (*_NODE, "gpus", "*", "migLayout"): LAYOUT_ALLOWED,
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
