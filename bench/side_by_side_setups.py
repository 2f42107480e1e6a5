"""The setups ``bench.side_by_side`` compares, each as one 8-GPU HGX H100 node as its slices
and the day's claims (``bench.autoscale_trace``) as that setup's users write them:

(a) NVIDIA's device plugin as people run it: GPUs 0-3 whole (``nvidia.com/gpu``), 4-5
    time-sliced into 4 replicas each (``nvidia.com/gpu.shared``), 6-7 in a fixed MIG layout,
    the GPU operator's ``all-balanced`` for H100 80GB (1g.10gb x2, 2g.20gb, 3g.40gb; mixed
    strategy). An extended resource is modelled as one device per unit (the scheduler counts
    units): whole GPUs and partitions keep flexgpu's classes, a profile selector standing for
    ``nvidia.com/mig-<profile>``; replicas have a class of their own.
(b) NVIDIA's DRA driver (sigs.k8s.io/dra-driver-nvidia-gpu v0.4.x) with its alpha
    ``DynamicMIG`` gate: the gate is node-wide, so all 8 GPUs publish the full GPU and every
    profile x placement on shared counters, in its own device order
    (``bench.scale_publications.nvidia_specs``). It has no consumable capacity, and MPS is
    refused while the gate is on; a claim for 20 GiB therefore takes the smallest MIG
    partition of about that size (1g.20gb: 20,096 MiB, a little under).
(c) flexgpu today: ``flexgpu node-template``'s slices for GPUs 0-3 whole, 4-5 shared
    (consumable memory/compute, MPS-enforced), 6-7 on-demand MIG (``bench.autoscale_replay``'s
    node group).
(c2) flexgpu today with (b)'s policy: every GPU on-demand MIG, the 20 GiB claims as 1g.20gb
    partitions; beside (b) it isolates what flexgpu's publication changes.
(d) flexgpu today's group (c) with node steering and consolidation (``bench.steering_replay``:
    new claims kept off the nodes closest to empty, ``driver.allocation.node_clearing``, and
    opted-in inference pods moved off a node steered too long); (d2) the same on (c2)'s
    all-MIG group. (d) against (c) is what steering does alone; (d2) against (c2) likewise,
    and (c2) against (c) is the policy's part.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any, Final

from bench.autoscale_replay import GROUP_POLICY, TOPOLOGY, device_classes
from bench.autoscale_trace import BY_NAME, ClaimKind
from bench.scale_publications import NodeInventory, inventory, nvidia_specs, scratch
from bench.steering_replay import SteeringOptions
from flexgpu.driver.allocation import DeviceClass, ResourceClaim, parse_claim, parse_device_class
from flexgpu.driver.gpu_model import GpuInfo
from flexgpu.driver.mig_devices import mig_attributes
from flexgpu.driver.names import DRIVER_NAME
from flexgpu.driver.node_template import TemplatePolicy, render_node_template
from flexgpu.driver.resource_slice import slice_specs, whole_gpu_device
from flexgpu.driver.topology import load_topology

NODE_PLACEHOLDER: Final = "<runtime:nodeName>"
TIME_SLICE_REPLICAS: Final = 4
# The GPU operator's default mig-parted config, "all-balanced", H100-80GB entry.
ALL_BALANCED_H100_80GB: Final = {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
REPLICA_CLASS: Final = "gpu-shared.device-plugin.bench"
SHARE_KIND: Final = "infer-share-20gi"
NVIDIA_SHARE_PROFILE: Final = "1g.20gb"


@dataclass(frozen=True)
class SpecTemplate:
    """Slice specs with the node name as a placeholder, as ``NodeTemplate.specs``."""

    specs: list[dict[str, Any]]


@dataclass
class Setup:
    key: str
    label: str
    template: SpecTemplate | None
    classes: dict[str, DeviceClass] = field(default_factory=dict)
    claims: dict[str, ResourceClaim] = field(default_factory=dict)
    not_run: str = ""  # why it is not run; empty when it is
    steering: SteeringOptions | None = None  # None: nothing steered, nobody moved


def _as_template(specs: list[dict[str, Any]]) -> SpecTemplate:
    out = copy.deepcopy(specs)
    for spec in out:
        spec["nodeName"] = NODE_PLACEHOLDER
        spec["pool"]["name"] = NODE_PLACEHOLDER
    return SpecTemplate(out)


def _claims(overrides: dict[str, ClaimKind]) -> dict[str, ResourceClaim]:
    return {
        name: parse_claim(overrides.get(name, kind).claim_body()) for name, kind in BY_NAME.items()
    }


def _with_requests(kind: ClaimKind, request: dict[str, Any]) -> ClaimKind:
    return ClaimKind(kind.name, kind.gpus, kind.min_minutes, kind.max_minutes, (request,))


def device_plugin() -> Setup:
    # Only the GPUs and their MIG profiles are taken from the inventory; the devices are built
    # here.
    inv = inventory("template", scratch(), dynamic=frozenset({6, 7}), shared=frozenset())
    devices: list[dict[str, Any]] = []
    for gpu in inv.gpus:
        if gpu.index < 4:
            devices.append(whole_gpu_device(gpu))
        elif gpu.index < 6:
            # Replicas of one GPU: no memory or fault isolation between them (time-slicing).
            for replica in range(TIME_SLICE_REPLICAS):
                attrs = {"type": {"string": "replica"}, "uuid": {"string": gpu.uuid}}
                devices.append({"name": f"gpu-{gpu.index}-replica-{replica}", "attributes": attrs})
        else:
            devices.extend(_fixed_mig(gpu, inv))
    replica_class = {
        "metadata": {"name": REPLICA_CLASS},
        "spec": {
            "selectors": [
                {"cel": {"expression": f'device.attributes["{DRIVER_NAME}"].type == "replica"'}}
            ]
        },
    }
    share = _with_requests(
        BY_NAME[SHARE_KIND], {"name": "share", "exactly": {"deviceClassName": REPLICA_CLASS}}
    )
    classes = device_classes() | {REPLICA_CLASS: parse_device_class(replica_class)}
    return Setup(
        "a",
        "NVIDIA device plugin",
        _as_template(slice_specs("template", devices, 1)),
        classes,
        _claims({SHARE_KIND: share}),
    )


def _fixed_mig(gpu: GpuInfo, inv: NodeInventory) -> list[dict[str, Any]]:
    """The all-balanced layout's partitions, largest first, each at the last placement still
    free: 3g.40gb at 4, 2g.20gb at 2, 1g.10gb at 1 and 0 (first-free would strand slice 7)."""
    used: set[int] = set()
    out: list[dict[str, Any]] = []
    for profile in sorted(inv.profiles, key=lambda p: -p.memory_slices):
        for _ in range(ALL_BALANCED_H100_80GB.get(profile.name, 0)):
            placement = next(
                p
                for p in reversed(profile.placements)
                if not used & set(range(p.start, p.start + p.size))
            )
            used |= set(range(placement.start, placement.start + placement.size))
            out.append(
                {
                    "name": f"gpu-{gpu.index}-mig-{profile.name}-{placement.start}",
                    "attributes": mig_attributes(gpu, profile, placement),
                }
            )
    return out


def _share_as_partition() -> ClaimKind:
    """The 20 GiB claim where no GPU is shared: the smallest partition of about that size
    (1g.20gb: 20096 MiB on an H100, a little under the 20 GiB asked)."""
    profile = f'device.attributes["{DRIVER_NAME}"].profile == "{NVIDIA_SHARE_PROFILE}"'
    selectors = [{"cel": {"expression": profile}}]
    request = {"deviceClassName": "mig.flexgpu.dev", "selectors": selectors}
    return _with_requests(BY_NAME[SHARE_KIND], {"name": "mig", "exactly": request})


def nvidia_dra() -> Setup:
    every = frozenset(range(8))
    inv = inventory("template", scratch(), dynamic=every, shared=frozenset())
    return Setup(
        "b",
        "NVIDIA DRA driver",
        _as_template(nvidia_specs("template", inv)),
        device_classes(),
        _claims({SHARE_KIND: _share_as_partition()}),
    )


def flexgpu_today() -> Setup:
    template = render_node_template(load_topology(TOPOLOGY), GROUP_POLICY)
    return Setup("c", "flexgpu today", SpecTemplate(template.specs), device_classes(), _claims({}))


def flexgpu_all_mig() -> Setup:
    policy = TemplatePolicy(shared=frozenset(), dynamic_mig=frozenset(range(8)))
    template = render_node_template(load_topology(TOPOLOGY), policy)
    return Setup(
        "c2",
        "flexgpu all-MIG",
        SpecTemplate(template.specs),
        device_classes(),
        _claims({SHARE_KIND: _share_as_partition()}),
    )


def steering(base: Setup, options: SteeringOptions | None = None) -> Setup:
    """``base``'s group with node steering (and eviction, as ``options`` say)."""
    key = "d" if base.key == "c" else f"d{base.key[1:]}"
    return replace(
        base, key=key, label=f"({base.key}) + steering", steering=options or SteeringOptions()
    )


def setups(options: SteeringOptions | None = None) -> list[Setup]:
    today, all_mig = flexgpu_today(), flexgpu_all_mig()
    return [
        device_plugin(),
        nvidia_dra(),
        today,
        all_mig,
        steering(today, options),
        steering(all_mig, options),
    ]
