"""Node templates for autoscalers: the ResourceSlices the kubelet plugin would publish on a
node that does not exist yet, for a GPU topology and a policy (whole, shared, static MIG
layout, on-demand MIG).

Cluster autoscalers decide which node group can serve a pending DRA claim by simulating the
scheduler against template slices, so a template must be what the plugin will publish. It is
built the way the plugin builds its slices: a simulated node of the topology (the simulated
backend), brought into the policy's state as the plugin's policy agent does (MIG mode, the
layout's instances, ``mig_layout.validate_layout``), each GPU rendered by the plugin's own
device functions (``resource_slice``, ``mig_devices``) and cut into slices by ``slice_specs``.
Only the choice of function per GPU mode mirrors ``kubelet_plugin.devices.node_devices``; an
integration test compares every template with what a running plugin publishes.

Values only the real node knows (node name, pool generation, GPU UUIDs, PCI addresses, PCIe
roots, NVLink domain names, which derive from UUIDs) are replaced by placeholders
``<runtime:KIND-N>``: equal placeholders stand for equal runtime values and different ones for
different values, so ``matchAttribute`` constraints simulate as they will run.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from flexgpu.driver.backend_errors import GpuBackendError
from flexgpu.driver.gpu_model import GpuInfo
from flexgpu.driver.mig_devices import (
    counter_set,
    dynamic_mig_devices,
    static_mig_devices,
    with_binding_conditions,
)
from flexgpu.driver.mig_layout import LayoutError, validate_layout
from flexgpu.driver.names import (
    PCI_BUS_ID_ATTRIBUTE,
    PCIE_ROOT_ATTRIBUTE,
    gpu_device_name,
)
from flexgpu.driver.node_policy import GpuMode, GpuNodePolicy, gpu_modes
from flexgpu.driver.resource_slice import (
    SliceDevice,
    shared_gpu_device,
    slice_specs,
    whole_gpu_device,
    with_tenant,
)
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.topology import NodeTopology

NODE_NAME_PLACEHOLDER: Final = "<runtime:nodeName>"
# Where the real generation goes; a template is the first generation a new node publishes.
TEMPLATE_GENERATION: Final = 1
# Device attribute -> placeholder kind. uuid and parentUUID share a kind: a MIG partition's
# parentUUID placeholder is its GPU's uuid placeholder.
RUNTIME_ATTRIBUTES: Final[Mapping[str, str]] = {
    "uuid": "uuid",
    "parentUUID": "uuid",
    "nvlinkDomain": "nvlinkDomain",
    PCI_BUS_ID_ATTRIBUTE: "pciBusID",
    PCIE_ROOT_ATTRIBUTE: "pcieRoot",
}
# Slice fields only the node knows (metadata.name and ownerReferences come with them).
RUNTIME_SLICE_FIELDS: Final = ("spec.nodeName", "spec.pool.name", "spec.pool.generation")
# The simulated node's name while rendering; every value derived from it is replaced.
_RENDER_NODE: Final = "flexgpu-template-node"


class TemplateError(ValueError):
    """The topology and policy do not make a node the plugin would serve; says which GPU and
    why."""


@dataclass(frozen=True)
class TemplatePolicy:
    """What the plugin is told: its ``--shared-gpus`` and ``--dynamic-mig-gpus`` defaults and
    the GpuNodePolicy that selects the node (it overrides the defaults for the GPUs it
    selects). ``mig_switch_needs_reset``: the GPUs need a reset to change MIG mode, so an
    on-demand MIG GPU serves partitions only (the plugin finds this out by trying)."""

    shared: frozenset[int] = frozenset()
    dynamic_mig: frozenset[int] = frozenset()
    policy: GpuNodePolicy | None = None
    mig_switch_needs_reset: bool = False
    # On-demand partitions and free shared GPUs carry binding conditions (the plugin's
    # default on 1.36+).
    binding_conditions: bool = False
    # The plugin's --shared-gpu-tenants: with "namespace" a shared GPU carries its tenant,
    # "" on a new node (the value a running node publishes varies; template_check.py).
    shared_gpu_tenants: str = "namespace"


@dataclass(frozen=True)
class GpuPlan:
    mode: GpuMode
    layout: Mapping[str, int] | None = None


@dataclass(frozen=True)
class NodeTemplate:
    """``specs``: every slice's ``spec`` in publication order, runtime values replaced by
    placeholders. ``placeholders``: placeholder -> the value it stood for on the render node
    (only meaningful to tests and to show the mapping). ``modes``: GPU index -> mode."""

    topology: str
    specs: list[dict[str, Any]]
    modes: dict[int, GpuMode]
    placeholders: dict[str, str] = field(default_factory=dict)

    def devices(self) -> list[SliceDevice]:
        return [d for spec in self.specs for d in spec.get("devices") or []]


def gpu_plans(policy: TemplatePolicy, gpus: Collection[GpuInfo]) -> dict[int, GpuPlan]:
    """GPU index -> mode, as the plugin's policy agent decides it: defaults from the flags,
    then the policy's entries for the GPUs they select."""
    count = len(gpus)
    for name, indices in (("shared", policy.shared), ("dynamicMig", policy.dynamic_mig)):
        out_of_range = sorted(i for i in indices if not 0 <= i < count)
        if out_of_range:
            raise TemplateError(
                f"{name}: GPU index {out_of_range[0]} is not on this topology; "
                f"allowed: 0..{count - 1}"
            )
    both = sorted(policy.shared & policy.dynamic_mig)
    if both:
        raise TemplateError(
            f"GPU {both[0]} is both shared and dynamic MIG; a GPU is either shared or partitioned"
        )
    plans = {g.index: GpuPlan(GpuMode.WHOLE) for g in gpus}
    plans.update({i: GpuPlan(GpuMode.SHARED) for i in policy.shared})
    plans.update({i: GpuPlan(GpuMode.DYNAMIC_MIG) for i in policy.dynamic_mig})
    if policy.policy is not None:
        for index, spec in gpu_modes(policy.policy, list(gpus)).items():
            plans[index] = GpuPlan(spec.mode, spec.mig_layout)
    return plans


def _prepare_static_mig(backend: SimulatedBackend, gpu: GpuInfo, layout: Mapping[str, int]) -> None:
    profiles = backend.mig_profiles(gpu.index) if gpu.mig_capable else []
    try:
        plan = validate_layout(layout, gpu, profiles)
    except LayoutError as err:
        # The plugin would leave this GPU tainted with the same message in the policy's status.
        raise TemplateError(f"GPU {gpu.index}: migLayout: {err.message}") from None
    backend.set_mig_mode(gpu.index, True)
    for step in plan:
        backend.create_mig_device(gpu.index, step.profile_id, step.placement)


def _render_gpu(
    backend: SimulatedBackend, gpu: GpuInfo, plan: GpuPlan, policy: TemplatePolicy
) -> tuple[list[SliceDevice], dict[str, Any] | None]:
    """The devices (and counter set) the plugin publishes for one healthy GPU."""
    if plan.mode == GpuMode.DYNAMIC_MIG and gpu.mig_capable:
        profiles = backend.mig_profiles(gpu.index)
        devices, parts = dynamic_mig_devices(gpu, profiles)
        if policy.binding_conditions:
            devices = [with_binding_conditions(d) if d["name"] in parts else d for d in devices]
        if policy.mig_switch_needs_reset:
            devices = [d for d in devices if d["name"] != gpu_device_name(gpu.index)]
        return devices, counter_set(gpu, profiles)
    adopted = plan.mode == GpuMode.WHOLE and gpu.mig_mode is not None and gpu.mig_mode.current
    if (plan.mode == GpuMode.MIG and gpu.mig_capable) or adopted:
        # A GPU already in MIG mode with no mode of its own serves the MIG devices it has,
        # never itself whole (the plugin's adoption rule, kubelet_plugin/devices/node_devices.py).
        devices, _ = static_mig_devices(
            gpu, backend.mig_profiles(gpu.index), backend.list_mig_devices(gpu.index)
        )
        return devices, None
    if plan.mode == GpuMode.SHARED:
        device = shared_gpu_device(gpu)
        if policy.shared_gpu_tenants == "namespace":
            device = with_tenant(device, "", binding_conditions=policy.binding_conditions)
        return [device], None
    # Whole, and MIG modes on a GPU without MIG: the plugin publishes those whole.
    return [whole_gpu_device(gpu)], None


def render_node_template(
    topology: NodeTopology,
    policy: TemplatePolicy = TemplatePolicy(),
    *,
    counters_in_own_slice: bool = True,
) -> NodeTemplate:
    """The slices a plugin publishes on a healthy, empty node of ``topology`` under
    ``policy``. ``counters_in_own_slice``: False for a 1.34 API server (``slice_specs``)."""
    backend = SimulatedBackend(topology, _RENDER_NODE)
    try:
        gpus = backend.list_gpus()
        plans = gpu_plans(policy, gpus)
        for gpu in gpus:
            plan = plans[gpu.index]
            if plan.mode == GpuMode.MIG and gpu.mig_capable:
                _prepare_static_mig(backend, gpu, plan.layout or {})
        devices: list[SliceDevice] = []
        dynamic: list[SliceDevice] = []
        counters: list[dict[str, Any]] = []
        for gpu in sorted(backend.list_gpus(), key=lambda g: g.index):
            mine, counter = _render_gpu(backend, gpu, plans[gpu.index], policy)
            # The plugin publishes on-demand MIG GPUs last (first fit takes ordinary GPUs first).
            (devices if counter is None else dynamic).extend(mine)
            if counter is not None:
                counters.append(counter)
        specs = slice_specs(
            _RENDER_NODE,
            devices + dynamic,
            TEMPLATE_GENERATION,
            counters,
            counters_in_own_slice=counters_in_own_slice,
        )
    except GpuBackendError as err:
        raise TemplateError(f"topology {topology.name}: {err}") from None
    finally:
        backend.close()
    placeholders = _Placeholders()
    for spec in specs:
        spec["nodeName"] = NODE_NAME_PLACEHOLDER
        spec["pool"]["name"] = NODE_NAME_PLACEHOLDER
        for device in spec.get("devices") or []:
            placeholders.replace_in(device)
    return NodeTemplate(
        topology=topology.name,
        specs=specs,
        modes={i: p.mode for i, p in sorted(plans.items())},
        placeholders=placeholders.real_values(),
    )


class _Placeholders:
    """Hands out ``<runtime:KIND-N>`` per distinct runtime value, in order of appearance."""

    def __init__(self) -> None:
        self._by_value: dict[tuple[str, str], str] = {}
        self._counts: dict[str, int] = {}

    def token(self, kind: str, value: str) -> str:
        key = (kind, value)
        if key not in self._by_value:
            number = self._counts.get(kind, 0)
            self._counts[kind] = number + 1
            self._by_value[key] = f"<runtime:{kind}-{number}>"
        return self._by_value[key]

    def replace_in(self, device: SliceDevice) -> None:
        attributes: dict[str, Any] = device.get("attributes") or {}
        for name, kind in RUNTIME_ATTRIBUTES.items():
            value = attributes.get(name)
            if isinstance(value, dict) and "string" in value:
                attributes[name] = {"string": self.token(kind, str(value["string"]))}

    def real_values(self) -> dict[str, str]:
        return {token: value for (_, value), token in self._by_value.items()}


def is_placeholder(value: object) -> bool:
    return isinstance(value, str) and value.startswith("<runtime:") and value.endswith(">")
