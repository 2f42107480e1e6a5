"""Static MIG layouts (profile name -> count, as admins write them for mig-parted): does a layout
fit a GPU, and at which placements are its instances created.

``validate_layout`` checks a layout against the profiles the GPU itself reports (on real
hardware the NVML backend reads them at run time) and finds a concrete placement for every
instance with a small backtracking search, largest profiles first. It enforces the rules NVML
enforces on create (see ``driver.mig_rules.check_mig_fit``): each instance at one of its
profile's placements, memory slices never shared, compute slices and per-profile instance
limits not exceeded. What it returns can be created, in the order given, on an empty GPU.

Pure: no I/O, no backend calls.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from flexgpu.driver.gpu_model import GpuInfo, MigDevice, MigPlacement, MigProfile

# A search over more instances than this is not a layout any GPU offers.
_MAX_INSTANCES = 64


class LayoutProblem(StrEnum):
    """Why a layout cannot be applied; the values are the status reasons of GpuNodePolicy."""

    UNSUPPORTED = "Unsupported"  # the GPU offers no MIG, or not one of the named profiles
    INVALID_LAYOUT = "InvalidLayout"  # the profiles exist but the instances do not fit


class LayoutError(ValueError):
    """A layout that cannot be created on a GPU. ``reason`` says which kind of problem,
    ``message`` the sentence for a status condition."""

    def __init__(self, reason: LayoutProblem, message: str) -> None:
        self.reason = reason
        self.message = message
        super().__init__(message)


@dataclass(frozen=True, order=True)
class MigPlacementPlan:
    """One GPU instance to create: ``profile_id`` (the NVML profile id every MIG call takes)
    at ``placement``."""

    placement_start: int
    placement_size: int
    profile_id: int
    profile_name: str

    @property
    def placement(self) -> MigPlacement:
        return MigPlacement(start=self.placement_start, size=self.placement_size)


def show_layout(layout: Mapping[str, int]) -> str:
    """``{"3g.40gb": 1, "1g.10gb": 2}``, keys in the order given."""
    return json.dumps(dict(layout), ensure_ascii=False)


def layout_of(mig_devices: Iterable[MigDevice]) -> dict[str, int]:
    """The layout (profile name -> count) the given MIG devices form, keys sorted by name.

    Half-created GPU instances (no compute instance) count too: they hold their slices.
    """
    counts = Counter(device.profile_name for device in mig_devices)
    return {name: counts[name] for name in sorted(counts)}


def memory_slice_count(profiles: Sequence[MigProfile]) -> int:
    """Memory slices of the GPU: the end of its furthest placement (8 on A100/H100/H200)."""
    return max((p.end for profile in profiles for p in profile.placements), default=0)


def compute_slice_count(profiles: Sequence[MigProfile]) -> int:
    """Compute slices of the GPU: those of its largest profile (7 on A100/H100/H200)."""
    return max((profile.compute_slices for profile in profiles), default=0)


def validate_layout(
    layout: Mapping[str, int], gpu: GpuInfo, profiles: Sequence[MigProfile]
) -> list[MigPlacementPlan]:
    """The GPU instances that realise ``layout`` on ``gpu``, sorted by placement start.

    ``profiles`` are the GPU's MIG profiles as its backend reports them. Raises
    ``LayoutError`` with reason ``Unsupported`` when the GPU has no MIG or does not offer a
    named profile, and ``InvalidLayout`` when a count is not positive or above the profile's
    limit, or the instances need more compute or memory slices than the GPU has, or no
    placement of them avoids overlapping memory slices.
    """
    product = gpu.product_name
    if not gpu.mig_capable or not profiles:
        raise LayoutError(LayoutProblem.UNSUPPORTED, f"{product} (GPU {gpu.index}) has no MIG")
    by_name = {profile.name: profile for profile in profiles}
    unknown = [name for name in layout if name not in by_name]
    if unknown:
        offered = ", ".join(profile.name for profile in profiles)
        names = ", ".join(json.dumps(name, ensure_ascii=False) for name in unknown)
        noun = "profile" if len(unknown) == 1 else "profiles"
        verb = "is" if len(unknown) == 1 else "are"
        raise LayoutError(
            LayoutProblem.UNSUPPORTED,
            f"{noun} {names} {verb} not offered by {product}; offered: {offered}",
        )
    for name, count in layout.items():
        profile = by_name[name]
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise LayoutError(
                LayoutProblem.INVALID_LAYOUT,
                f"profile {name}: {count!r} instances is not a count; allowed: 0 to "
                f"{profile.max_instances}",
            )
        if count > profile.max_instances:
            raise LayoutError(
                LayoutProblem.INVALID_LAYOUT,
                f"profile {name}: {count} instances are more than {product} allows "
                f"(at most {profile.max_instances})",
            )
    shown = show_layout(layout)
    compute_total = compute_slice_count(profiles)
    compute = sum(by_name[name].compute_slices * count for name, count in layout.items())
    if compute > compute_total:
        raise LayoutError(
            LayoutProblem.INVALID_LAYOUT,
            f"layout {shown} needs {compute} compute slices; {product} has {compute_total}",
        )
    memory_total = memory_slice_count(profiles)
    memory = sum(by_name[name].memory_slices * count for name, count in layout.items())
    if memory > memory_total:
        raise LayoutError(
            LayoutProblem.INVALID_LAYOUT,
            f"layout {shown} needs {memory} memory slices; {product} has {memory_total}",
        )
    # Largest first: they have the fewest placements, so dead ends show up early.
    wanted = sorted(
        (by_name[name] for name, count in layout.items() for _ in range(count)),
        key=lambda p: (-p.memory_slices, -p.compute_slices, len(p.placements), p.name),
    )
    if len(wanted) > _MAX_INSTANCES:  # unreachable with real limits; bounds the search
        raise LayoutError(
            LayoutProblem.INVALID_LAYOUT, f"layout {shown} has more than {_MAX_INSTANCES} instances"
        )
    found = _place(wanted, 0, [], -1)
    if found is None:
        where = "; ".join(
            f"{profile.name} at " + ", ".join(_slices(p) for p in profile.placements)
            for profile in _unique(wanted)
        )
        raise LayoutError(
            LayoutProblem.INVALID_LAYOUT,
            f"layout {shown} does not fit {product}: no choice of placements keeps the "
            f"instances' memory slices apart (memory slices each profile may take: {where})",
        )
    return sorted(
        MigPlacementPlan(p.start, p.size, profile.profile_id, profile.name)
        for profile, p in zip(wanted, found, strict=True)
    )


def _place(
    wanted: Sequence[MigProfile], at: int, taken: list[MigPlacement], previous: int
) -> list[MigPlacement] | None:
    """Placements for ``wanted[at:]`` next to ``taken``, or None. Instances of one profile are
    interchangeable, so a profile's next instance only tries placements after the previous
    one's (``previous`` is that placement's position in the profile's list)."""
    if at == len(wanted):
        return []
    profile = wanted[at]
    for position, placement in enumerate(profile.placements):
        if position <= previous:
            continue
        if any(placement.overlaps(other) for other in taken):
            continue
        same_next = at + 1 < len(wanted) and wanted[at + 1] == profile
        rest = _place(wanted, at + 1, [*taken, placement], position if same_next else -1)
        if rest is not None:
            return [placement, *rest]
    return None


def _unique(profiles: Sequence[MigProfile]) -> list[MigProfile]:
    seen: list[MigProfile] = []
    for profile in profiles:
        if profile not in seen:
            seen.append(profile)
    return seen


def _slices(placement: MigPlacement) -> str:
    if placement.size == 1:
        return str(placement.start)
    return f"{placement.start}-{placement.end - 1}"
