"""Does a node publish what its template says? Field by field, with each placeholder bound to
one runtime value and each runtime value to one placeholder, so a node whose GPUs group
differently (another NVLink fabric, other PCIe roots) is told apart as surely as one with other
GPUs. The pool generation counts the node's own republishes and is not compared.

Autoscalers assume every node of a group publishes its template (cluster-autoscaler: identical
device sets per node group); this is how a platform team checks a running node of the group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flexgpu.driver.names import TENANT_ATTRIBUTE, TENANT_READY_CONDITION
from flexgpu.driver.node_template import NODE_NAME_PLACEHOLDER, NodeTemplate, is_placeholder

_TENANT_PATH = f".attributes.{TENANT_ATTRIBUTE}"


def current_pool(slices: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ``spec`` of each slice of the pool's highest generation, in the plugin's order (its
    slice names end in their position)."""
    if not slices:
        return []
    newest = max(int(s["spec"]["pool"]["generation"]) for s in slices)
    current = [s for s in slices if int(s["spec"]["pool"]["generation"]) == newest]

    def position(item: Mapping[str, Any]) -> tuple[int, str]:
        name = str(item["metadata"]["name"])
        tail = name.rsplit("-", 1)[-1]
        return (int(tail) if tail.isdigit() else 1 << 30, name)

    return [dict(s["spec"]) for s in sorted(current, key=position)]


class _Bindings:
    def __init__(self, node_name: str) -> None:
        self.value: dict[str, Any] = {NODE_NAME_PLACEHOLDER: node_name}
        self.token: dict[str, str] = {node_name: NODE_NAME_PLACEHOLDER}

    def bind(self, placeholder: str, real: Any, path: str) -> list[str]:
        known = self.value.setdefault(placeholder, real)
        if known != real:
            return [f"{path}: {placeholder} is {known!r} elsewhere on the node, here {real!r}"]
        other = self.token.setdefault(str(real), placeholder)
        if other != placeholder:
            return [f"{path}: {real!r} stands for {other} elsewhere, here for {placeholder}"]
        return []


def _compare(template: Any, real: Any, path: str, bindings: _Bindings) -> list[str]:
    if is_placeholder(template):
        return bindings.bind(template, real, path)
    if (
        path.endswith(_TENANT_PATH)
        and isinstance(real, dict)
        and isinstance(real.get("string"), str)
    ):
        return []  # a shared GPU's tenant is the namespace it serves now ("" on a new node)
    if isinstance(template, dict) and isinstance(real, dict):
        found = [f"{path}.{k}: in the template, not on the node" for k in template.keys() - real]
        found += [f"{path}.{k}: on the node, not in the template" for k in real.keys() - template]
        for key in sorted(template.keys() & real.keys()):
            found += _compare(template[key], real[key], f"{path}.{key}", bindings)
        return found
    if isinstance(template, list) and isinstance(real, list):
        if len(template) != len(real):
            return [f"{path}: {len(template)} entries in the template, {len(real)} on the node"]
        found = []
        for i, (mine, theirs) in enumerate(zip(template, real, strict=True)):
            label = mine.get("name", i) if isinstance(mine, dict) else i
            found += _compare(mine, theirs, f"{path}[{label}]", bindings)
        return found
    return [] if template == real else [f"{path}: template {template!r}, node {real!r}"]


def _as_free(template: Mapping[str, Any], real: Mapping[str, Any]) -> Mapping[str, Any]:
    """A shared GPU that serves a namespace now, as it is published while free: a held GPU
    drops the tenant binding conditions a free one carries (resource_slice.with_tenant)."""
    tenant = (real.get("attributes") or {}).get(TENANT_ATTRIBUTE) or {}
    held = bool(tenant.get("string"))
    if not held or TENANT_READY_CONDITION not in (template.get("bindingConditions") or []):
        return real
    conditions = ("bindingConditions", "bindingFailureConditions")
    return {**real, **{key: template[key] for key in conditions if key in template}}


def _free_devices(template: Mapping[str, Any], real: Mapping[str, Any]) -> Mapping[str, Any]:
    mine = {d.get("name"): d for d in template.get("devices") or []}
    devices = [_as_free(mine.get(d.get("name")) or {}, d) for d in real.get("devices") or []]
    return {**real, "devices": devices} if "devices" in real else real


def template_differences(
    template: NodeTemplate, published: Sequence[Mapping[str, Any]], node_name: str
) -> list[str]:
    """Every difference between the template and the node's current slices (``current_pool``
    of what the API server holds); empty when the node publishes exactly the template."""
    if len(template.specs) != len(published):
        mine = sum(len(s.get("devices") or []) for s in template.specs)
        theirs = sum(len(s.get("devices") or []) for s in published)
        return [
            f"{len(template.specs)} slices with {mine} devices in the template, "
            f"{len(published)} with {theirs} on node {node_name}"
        ]
    bindings = _Bindings(node_name)
    found: list[str] = []
    for i, (spec, node_spec) in enumerate(zip(template.specs, published, strict=True)):
        pool = {**node_spec.get("pool", {}), "generation": spec["pool"]["generation"]}
        real = _free_devices(spec, {**node_spec, "pool": pool})
        found += _compare(spec, real, f"slice[{i}]", bindings)
    return found
