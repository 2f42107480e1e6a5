"""Which policy applies to a node, and what it asks of each of the node's GPUs.

Choosing a policy (``select_policy``): of the policies whose ``nodeSelector`` matches the node
(and that are not being deleted), the one with the highest ``priority`` wins. Two or more at the
top priority are a conflict: no policy wins and the plugin changes nothing on its GPUs; it
keeps what it applied last (or, on a first start, its command-line defaults, which never
destroy MIG devices) and reports reason ``Conflict`` on each tied policy until an admin
resolves the tie. Picking one of them (by name, say) would reconfigure GPUs, and maybe destroy
MIG devices, on a choice the admin never made.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from flexgpu.driver.gpu_model import GpuInfo
from flexgpu.driver.node_policy.model import ExistingMigDevices, GpuMode, GpuNodePolicy
from flexgpu.driver.opaque_config import GpuSharing


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
    existing_mig: ExistingMigDevices = ExistingMigDevices.KEEP


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
                    existing_mig=entry.existingMigDevices,
                )
    return dict(sorted(out.items()))
