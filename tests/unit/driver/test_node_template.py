"""Node templates for autoscalers: the modes the plugin's flags and a GpuNodePolicy ask for,
runtime-only values replaced consistently, bad settings refused with the GPU and the reason,
and the cluster-autoscaler and Karpenter shapes. That a template equals what a running plugin
publishes is proven in tests/integration/test_node_template_e2e.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from flexgpu.driver.autoscaler_shapes import (
    RUNTIME_ANNOTATION,
    TOPOLOGY_ANNOTATION,
    cluster_autoscaler_slices,
    karpenter_dynamic_resources,
    render_shape,
)
from flexgpu.driver.node_policy import GpuMode, parse_node_policy
from flexgpu.driver.node_template import (
    NODE_NAME_PLACEHOLDER,
    RUNTIME_ATTRIBUTES,
    TemplateError,
    TemplatePolicy,
    is_placeholder,
    render_node_template,
)
from flexgpu.driver.topology import load_topology

H100 = load_topology("hgx-h100-8")
L4 = load_topology("l4-2-pcie")


def by_name(template: Any) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in template.devices()}


def attribute(device: dict[str, Any], name: str) -> Any:
    return next(iter(device["attributes"][name].values()))


def policy(gpus: list[dict[str, Any]]) -> Any:
    return parse_node_policy(
        {
            "apiVersion": "flexgpu.dev/v1alpha1",
            "kind": "GpuNodePolicy",
            "metadata": {"name": "p"},
            "spec": {"gpus": gpus},
        }
    )


def test_whole_gpus_by_default_one_per_gpu_in_index_order() -> None:
    template = render_node_template(H100)
    # GPUs 6 and 7 of the topology are in MIG mode: they serve the MIG devices they have
    # (none on a new node), never themselves whole, as the plugin does.
    assert [d["name"] for d in template.devices()] == [f"gpu-{i}" for i in range(6)]
    assert {attribute(d, "type") for d in template.devices()} == {"gpu"}
    assert template.modes == dict.fromkeys(range(8), GpuMode.WHOLE)
    assert template.specs[0]["pool"]["resourceSliceCount"] == 1


def test_shared_gpus_are_consumable_and_the_rest_whole() -> None:
    devices = by_name(render_node_template(H100, TemplatePolicy(shared=frozenset({1, 2}))))
    assert devices["gpu-1"]["allowMultipleAllocations"] is True
    assert set(devices["gpu-1"]["capacity"]) == {"memory", "compute", "multiprocessors"}
    assert "allowMultipleAllocations" not in devices["gpu-0"]


def test_on_demand_mig_publishes_counters_first_and_its_gpus_last() -> None:
    template = render_node_template(H100, TemplatePolicy(dynamic_mig=frozenset({0})))
    counters, devices = template.specs
    assert [c["name"] for c in counters["sharedCounters"]] == ["gpu-0"]
    names = [d["name"] for d in devices["devices"]]
    # Ordinary GPUs first (first fit), then GPU 0 whole, then its partitions.
    # (GPUs 6 and 7 are in MIG mode with no MIG devices: nothing of theirs is published.)
    assert names[:6] == ["gpu-1", "gpu-2", "gpu-3", "gpu-4", "gpu-5", "gpu-0"]
    assert all(n.startswith("gpu-0-mig-") for n in names[6:]) and len(names) > 20


def test_mig_mode_needing_a_reset_leaves_out_the_whole_gpu_of_on_demand_mig_gpus() -> None:
    needs_reset = TemplatePolicy(dynamic_mig=frozenset({0}), mig_switch_needs_reset=True)
    names = set(by_name(render_node_template(H100, needs_reset)))
    assert "gpu-0" not in names and "gpu-0-mig-7g80gb-0" in names


def test_before_1_35_counter_sets_travel_with_their_devices() -> None:
    template = render_node_template(
        H100, TemplatePolicy(dynamic_mig=frozenset({0})), counters_in_own_slice=False
    )
    first = template.specs[0]
    assert [c["name"] for c in first["sharedCounters"]] == ["gpu-0"]
    assert all(d["name"].startswith("gpu-0") for d in first["devices"])


def test_a_policy_overrides_the_flags_for_the_gpus_it_selects() -> None:
    node_policy = policy(
        [
            {"selector": {"indices": [1]}, "mode": "MIG", "migLayout": {"3g.40gb": 2}},
            {"selector": {"indices": [0]}, "mode": "Whole"},
        ]
    )
    template = render_node_template(
        H100, TemplatePolicy(shared=frozenset({0, 2}), policy=node_policy)
    )
    names = set(by_name(template))
    assert {"gpu-1-mig-3g40gb-0", "gpu-1-mig-3g40gb-4"} <= names and "gpu-1" not in names
    assert template.modes[0] == GpuMode.WHOLE and template.modes[2] == GpuMode.SHARED
    mig = by_name(template)["gpu-1-mig-3g40gb-0"]
    # A static partition's own UUID and its parent's are different placeholders.
    assert attribute(mig, "uuid") != attribute(mig, "parentUUID")
    devices = by_name(template)
    other = devices["gpu-1-mig-3g40gb-4"]
    assert attribute(other, "parentUUID") == attribute(mig, "parentUUID")
    assert attribute(other, "uuid") != attribute(mig, "uuid")
    whole = {attribute(devices[f"gpu-{i}"], "uuid") for i in (0, 2, 3)}
    assert attribute(mig, "parentUUID") not in whole


def test_runtime_values_are_placeholders_that_group_as_on_the_node() -> None:
    template = render_node_template(H100, TemplatePolicy(dynamic_mig=frozenset({7})))
    text = json.dumps(template.specs)
    for real in template.placeholders.values():
        assert real not in text
    for bus_id in ("0000:1b:00.0", "GPU-"):
        assert bus_id not in text
    devices = by_name(template)
    for device in devices.values():
        for name in RUNTIME_ATTRIBUTES:
            if name in device["attributes"]:
                assert is_placeholder(attribute(device, name)), (device["name"], name)
    # NVSwitch: one NVLink domain for all; each GPU its own UUID and PCI address.
    assert len({attribute(d, "nvlinkDomain") for d in devices.values()}) == 1
    whole = [0, 1, 2, 3, 4, 5, 7]  # GPU 6 is in MIG mode with no MIG devices
    assert len({attribute(devices[f"gpu-{i}"], "uuid") for i in whole}) == len(whole)
    # A partition's parent is its GPU, placeholder for placeholder.
    gpu7 = attribute(devices["gpu-7"], "uuid")
    partitions = [d for n, d in devices.items() if n.startswith("gpu-7-mig-")]
    assert {attribute(d, "parentUUID") for d in partitions} == {gpu7}
    assert all(s["nodeName"] == NODE_NAME_PLACEHOLDER for s in template.specs)
    assert all(s["pool"]["name"] == NODE_NAME_PLACEHOLDER for s in template.specs)


def test_gpus_without_nvlink_get_different_domains() -> None:
    devices = render_node_template(L4).devices()
    assert attribute(devices[0], "nvlinkDomain") != attribute(devices[1], "nvlinkDomain")


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (TemplatePolicy(shared=frozenset({2})), "shared: GPU index 2 is not on this topology"),
        (
            TemplatePolicy(shared=frozenset({0}), dynamic_mig=frozenset({0})),
            "GPU 0 is both shared and dynamic MIG",
        ),
    ],
)
def test_settings_the_node_cannot_have_are_refused(settings: TemplatePolicy, message: str) -> None:
    with pytest.raises(TemplateError, match=message):
        render_node_template(L4, settings)


def test_a_layout_the_gpu_cannot_hold_names_the_gpu_and_the_reason() -> None:
    too_many = policy([{"selector": {"indices": [3]}, "mode": "MIG", "migLayout": {"3g.40gb": 3}}])
    with pytest.raises(TemplateError, match=r"GPU 3: migLayout: .*3g\.40gb"):
        render_node_template(H100, TemplatePolicy(policy=too_many))


def test_cluster_autoscaler_shape_is_a_list_of_resource_slices() -> None:
    template = render_node_template(H100, TemplatePolicy(dynamic_mig=frozenset({0})))
    shaped = cluster_autoscaler_slices(template)
    assert shaped["kind"] == "List"
    assert [i["kind"] for i in shaped["items"]] == ["ResourceSlice", "ResourceSlice"]
    assert [i["spec"] for i in shaped["items"]] == template.specs
    annotations = shaped["items"][0]["metadata"]["annotations"]
    assert annotations[TOPOLOGY_ANNOTATION] == "hgx-h100-8"
    assert "uuid" in annotations[RUNTIME_ANNOTATION]


def test_karpenter_shape_leaves_runtime_attributes_out_and_binds_the_devices_sharing_them() -> None:
    template = render_node_template(H100, TemplatePolicy(dynamic_mig=frozenset({7})))
    shaped = karpenter_dynamic_resources(template)
    counters, devices = shaped["resourceSliceTemplates"]
    assert "devices" not in counters and counters["sharedCounters"][0]["name"] == "gpu-7"
    assert counters["pool"] == devices["pool"] == {"name": NODE_NAME_PLACEHOLDER}
    for device in devices["devices"]:
        assert not set(device["attributes"]) & set(RUNTIME_ATTRIBUTES), device["name"]
    partitions = [d for d in devices["devices"] if d["name"].startswith("gpu-7-mig-")]
    assert all(d["consumesCounters"] for d in partitions)
    bindings = {
        (b["attribute"], frozenset(d["device"] for d in b["devices"]))
        for b in shaped["attributeBindings"]
    }
    everything = frozenset(d["name"] for d in devices["devices"])
    assert ("gpu.flexgpu.dev/nvlinkDomain", everything) in bindings
    assert ("gpu.flexgpu.dev/parentUUID", frozenset(d["name"] for d in partitions)) in bindings
    # Whole GPUs share no UUID: no binding of one device.
    assert all(len(devs) >= 2 for _, devs in bindings)


def test_no_binding_where_no_two_devices_share_a_value() -> None:
    shaped = karpenter_dynamic_resources(render_node_template(L4))
    assert shaped["attributeBindings"] == []


def test_unknown_shape_is_refused_with_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="allowed values: cluster-autoscaler, karpenter"):
        render_shape(render_node_template(L4), "autopilot")
