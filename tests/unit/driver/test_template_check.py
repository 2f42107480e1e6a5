"""Comparing a node's slices with its template: equal when only placeholders differ and they
bind one-to-one; every other difference is named by its path. The node's slices here are the
template filled in as a node would fill it, then changed the way a real node could differ."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from flexgpu.driver.node_template import TemplatePolicy, is_placeholder, render_node_template
from flexgpu.driver.template_check import current_pool, template_differences
from flexgpu.driver.topology import load_topology

TEMPLATE = render_node_template(
    load_topology("hgx-h100-8"), TemplatePolicy(shared=frozenset({1}), dynamic_mig=frozenset({7}))
)
NODE = "gpu-a"


def filled(value: Any) -> Any:
    """The node's values: its name, and one value per placeholder."""
    if is_placeholder(value):
        return NODE if value == "<runtime:nodeName>" else f"value-of-{value[9:-1]}"
    if isinstance(value, dict):
        return {k: filled(v) for k, v in value.items()}
    if isinstance(value, list):
        return [filled(v) for v in value]
    return value


def node_specs() -> list[dict[str, Any]]:
    specs: list[dict[str, Any]] = filled(copy.deepcopy(TEMPLATE.specs))
    for spec in specs:
        spec["pool"]["generation"] = 7  # the node has republished: not a difference
    return specs


def device(specs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(d for s in specs for d in s.get("devices") or [] if d["name"] == name)


def test_a_node_that_fills_in_the_placeholders_matches() -> None:
    assert template_differences(TEMPLATE, node_specs(), NODE) == []


def test_another_node_name_is_a_difference() -> None:
    assert template_differences(TEMPLATE, node_specs(), "gpu-b")


def test_a_changed_capacity_is_named_by_its_path() -> None:
    specs = node_specs()
    device(specs, "gpu-1")["capacity"]["memory"]["value"] = "40Gi"
    (found,) = template_differences(TEMPLATE, specs, NODE)
    assert "devices[gpu-1].capacity.memory.value" in found and "'40Gi'" in found


def test_gpus_that_group_differently_are_told_apart() -> None:
    # Two NVLink domains where the template has one.
    specs = node_specs()
    device(specs, "gpu-3")["attributes"]["nvlinkDomain"] = {"string": "another-domain"}
    found = template_differences(TEMPLATE, specs, NODE)
    assert any("gpu-3].attributes.nvlinkDomain" in line for line in found)
    # Two GPUs with one UUID where the template has two.
    specs = node_specs()
    device(specs, "gpu-2")["attributes"]["uuid"] = device(specs, "gpu-0")["attributes"]["uuid"]
    found = template_differences(TEMPLATE, specs, NODE)
    assert any("gpu-2].attributes.uuid" in line for line in found)


def test_a_missing_device_or_extra_field_is_a_difference() -> None:
    specs = node_specs()
    specs[1]["devices"].pop()
    assert any(
        "entries in the template" in line for line in template_differences(TEMPLATE, specs, NODE)
    )
    specs = node_specs()
    device(specs, "gpu-0")["taints"] = [{"key": "k", "effect": "NoSchedule"}]
    (found,) = template_differences(TEMPLATE, specs, NODE)
    assert "gpu-0].taints: on the node, not in the template" in found


def test_a_pool_of_another_size_says_so() -> None:
    (found,) = template_differences(TEMPLATE, node_specs()[1:], NODE)
    assert found.startswith("2 slices with") and "1 with" in found


@pytest.mark.parametrize("generations", [(3, 4), (4, 3)])
def test_current_pool_takes_the_newest_generation_in_slice_order(
    generations: tuple[int, int],
) -> None:
    old, new = generations
    items = [
        {
            "metadata": {"name": f"n-gpu.flexgpu.dev-{i}"},
            "spec": {"pool": {"generation": g}, "i": i},
        }
        for g in (old, new)
        for i in (1, 0)
    ]
    newest = max(generations)
    assert [s["i"] for s in current_pool(items)] == [0, 1]
    assert {s["pool"]["generation"] for s in current_pool(items)} == {newest}
    assert current_pool([]) == []
