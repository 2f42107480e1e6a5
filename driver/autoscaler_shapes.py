"""A node template (``driver.node_template``) in the shapes autoscalers take.

- cluster-autoscaler: a node group's template node comes with template ResourceSlices, whole
  ``resource.k8s.io/v1`` objects whose node name and pool name it rewrites for each simulated
  node. Here: a ``List`` of ResourceSlices, placeholders kept, annotations saying which values
  are runtime-only.
- Karpenter (``sigs.k8s.io/karpenter`` v1.15, ``cloudprovider.DynamicResources``): an instance
  type's ``ResourceSliceTemplates`` (driver, pool name, devices with attributes, capacity,
  ``allowMultipleAllocations`` and ``consumesCounters``; counter sets in slices of their own)
  and ``AttributeBindings``: sets of devices that will share an attribute's value at run time,
  so ``matchAttribute`` on a runtime-only attribute (NVLink domain, PCIe root, a MIG
  partition's parent) simulates as it will run. Runtime-only attributes are left out of the
  devices, as Karpenter expects. The Go types carry no JSON tags; the field names here are
  theirs in camelCase, which is what a provider decodes into them.
"""

from __future__ import annotations

import json
from typing import Any, Final

from flexgpu.driver.names import DRIVER_NAME
from flexgpu.driver.node_template import (
    NODE_NAME_PLACEHOLDER,
    RUNTIME_ATTRIBUTES,
    RUNTIME_SLICE_FIELDS,
    NodeTemplate,
)

TOPOLOGY_ANNOTATION: Final = f"{DRIVER_NAME}/template-topology"
RUNTIME_ANNOTATION: Final = f"{DRIVER_NAME}/template-runtime-values"
FORMATS: Final = ("cluster-autoscaler", "karpenter")
# Karpenter leaves out bindings of fewer devices.
MIN_BINDING_DEVICES: Final = 2


def qualified_attribute(name: str) -> str:
    """Unqualified attributes live under the driver's domain (as CEL and matchAttribute see
    them)."""
    return name if "/" in name else f"{DRIVER_NAME}/{name}"


def runtime_values_note() -> str:
    attributes = ", ".join(sorted(RUNTIME_ATTRIBUTES))
    return (
        f"{', '.join(RUNTIME_SLICE_FIELDS)}, metadata.name and the device attributes "
        f"{attributes} are known only on the node; here they hold <runtime:...> placeholders "
        "(equal placeholders stand for equal values)"
    )


def cluster_autoscaler_slices(template: NodeTemplate) -> dict[str, Any]:
    items = [
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {
                # The plugin's own slice names: <node>-<driver>-<i>.
                "name": f"{NODE_NAME_PLACEHOLDER}-{DRIVER_NAME}-{i}",
                "annotations": {
                    TOPOLOGY_ANNOTATION: template.topology,
                    RUNTIME_ANNOTATION: runtime_values_note(),
                },
            },
            "spec": spec,
        }
        for i, spec in enumerate(template.specs)
    ]
    return {"apiVersion": "v1", "kind": "List", "items": items}


def _karpenter_device(device: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"name": device["name"]}
    out["attributes"] = {
        name: value
        for name, value in (device.get("attributes") or {}).items()
        if name not in RUNTIME_ATTRIBUTES
    }
    if device.get("capacity"):
        out["capacity"] = device["capacity"]
    if device.get("allowMultipleAllocations"):
        out["allowMultipleAllocations"] = True
    if device.get("consumesCounters"):
        out["consumesCounters"] = device["consumesCounters"]
    return out


def attribute_bindings(template: NodeTemplate, pool: str) -> list[dict[str, Any]]:
    """For each runtime-only attribute, the groups of devices whose values are equal."""
    groups: dict[tuple[str, str], list[str]] = {}
    for device in template.devices():
        for name, value in (device.get("attributes") or {}).items():
            if name in RUNTIME_ATTRIBUTES and isinstance(value, dict) and "string" in value:
                groups.setdefault((name, json.dumps(value)), []).append(device["name"])
    return [
        {
            "attribute": qualified_attribute(name),
            "devices": [{"driver": DRIVER_NAME, "pool": pool, "device": d} for d in devices],
        }
        for (name, _), devices in groups.items()
        if len(devices) >= MIN_BINDING_DEVICES
    ]


def karpenter_dynamic_resources(template: NodeTemplate) -> dict[str, Any]:
    """``InstanceType.DynamicResources`` of one instance type. The pool name is the node's at
    run time: a provider may set any name, the same in every template and binding."""
    pool = NODE_NAME_PLACEHOLDER
    templates: list[dict[str, Any]] = []
    for spec in template.specs:
        entry: dict[str, Any] = {"driver": spec["driver"], "pool": {"name": pool}}
        if spec.get("sharedCounters"):
            entry["sharedCounters"] = spec["sharedCounters"]
        else:
            entry["devices"] = [_karpenter_device(d) for d in spec.get("devices") or []]
        templates.append(entry)
    return {
        "resourceSliceTemplates": templates,
        "attributeBindings": attribute_bindings(template, pool),
    }


def render_shape(template: NodeTemplate, shape: str) -> dict[str, Any]:
    if shape == "cluster-autoscaler":
        return cluster_autoscaler_slices(template)
    if shape == "karpenter":
        return karpenter_dynamic_resources(template)
    raise ValueError(f"format {shape!r}: allowed values: {', '.join(FORMATS)}")
