"""Node templates against the plugin's own device state, without an API server: for every
built-in topology and the plugin's flags, the slices ``NodeDevices`` would have published (cut
by the publisher's ``slice_specs``) equal the template, placeholders bound one-to-one; on GPUs
whose MIG mode change needs a reset, too. The API-server round trip, static MIG from a
GpuNodePolicy and the command are covered by tests/integration/test_node_template_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexgpu.driver.node_template import TemplatePolicy, render_node_template
from flexgpu.driver.resource_slice import slice_specs
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.template_check import template_differences
from flexgpu.driver.topology import builtin_topology_names, load_topology
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from tests.unit.kubelet_plugin.test_dynamic_whole_gpu import ResetToSwitch

NODE = "node-a"


def published(devices: NodeDevices, *, own_slice: bool = True) -> list[dict[str, object]]:
    return slice_specs(
        NODE, devices.slice_devices(), 1, devices.counter_sets(), counters_in_own_slice=own_slice
    )


def modes(count: int) -> dict[str, tuple[frozenset[int], frozenset[int]]]:
    everything = frozenset(range(count))
    return {
        "whole": (frozenset(), frozenset()),
        "shared": (everything, frozenset()),
        "on-demand-mig": (frozenset(), everything),
        "mixed": (frozenset({0}), frozenset({count - 1}) if count > 1 else frozenset()),
    }


@pytest.mark.parametrize("topology", builtin_topology_names())
@pytest.mark.parametrize("mode", ["whole", "shared", "on-demand-mig", "mixed"])
@pytest.mark.parametrize("own_slice", [True, False], ids=["1.35+", "1.34"])
def test_template_equals_what_the_plugin_would_publish(
    topology: str, mode: str, own_slice: bool
) -> None:
    loaded = load_topology(topology)
    shared, dynamic = modes(len(loaded.gpus))[mode]
    backend = SimulatedBackend(loaded, NODE)
    devices = NodeDevices(backend, shared, dynamic, publish_tenants=True)
    # A running node's shared GPU serves some namespace; the template's says "" (a new node).
    devices.set_tenants(dict.fromkeys(shared, "team-a"))
    template = render_node_template(
        loaded, TemplatePolicy(shared=shared, dynamic_mig=dynamic), counters_in_own_slice=own_slice
    )
    found = template_differences(template, published(devices, own_slice=own_slice), NODE)
    assert not found, "\n".join(found[:20])


def test_without_tenancy_neither_publishes_a_tenant() -> None:
    """--shared-gpu-tenants=any: no tenant attribute on the node or in the template, and a
    node that publishes one where its template has none is told apart."""
    loaded = load_topology("hgx-h100-8")
    shared = frozenset({4, 5})
    template = render_node_template(loaded, TemplatePolicy(shared=shared, shared_gpu_tenants="any"))
    plain = NodeDevices(SimulatedBackend(loaded, NODE), shared)
    assert not template_differences(template, published(plain), NODE)
    tenanted = NodeDevices(SimulatedBackend(loaded, NODE), shared, publish_tenants=True)
    found = template_differences(template, published(tenanted), NODE)
    assert found and all("tenant: on the node, not in the template" in f for f in found)


def test_gpus_that_need_a_reset_to_switch_mig_mode(tmp_path: Path) -> None:
    backend = ResetToSwitch.from_topology("hgx-h100-8", NODE, state_path=tmp_path / "state.json")
    for index in (6, 7):
        SimulatedBackend.set_mig_mode(backend, index, True)  # as an admin left them
    devices = NodeDevices(backend, dynamic_mig={6, 7})
    policy = TemplatePolicy(dynamic_mig=frozenset({6, 7}), mig_switch_needs_reset=True)
    template = render_node_template(load_topology("hgx-h100-8"), policy)
    assert template_differences(template, published(devices), NODE) == []
    # Without the flag the template promises whole GPUs this node does not publish.
    promising = render_node_template(
        load_topology("hgx-h100-8"), TemplatePolicy(dynamic_mig=frozenset({6, 7}))
    )
    assert template_differences(promising, published(devices), NODE)


@pytest.mark.parametrize("topology", ["hgx-h100-8", "dgx-a100-8"])
def test_template_carries_binding_conditions_as_the_plugin_publishes_them(topology: str) -> None:
    """On 1.36+ the plugin's on-demand partitions carry binding conditions; a template
    without them would differ from the node (and --compare-node would say so)."""
    loaded = load_topology(topology)
    dynamic = frozenset({0, 1})
    devices = NodeDevices(
        SimulatedBackend(loaded, NODE), dynamic_mig=dynamic, binding_conditions=True
    )
    template = render_node_template(
        loaded, TemplatePolicy(dynamic_mig=dynamic, binding_conditions=True)
    )
    assert template_differences(template, published(devices), NODE) == []
    plain = render_node_template(loaded, TemplatePolicy(dynamic_mig=dynamic))
    assert any(
        "bindingConditions" in line
        for line in template_differences(plain, published(devices), NODE)
    )
