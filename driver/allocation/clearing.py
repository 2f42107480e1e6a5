"""Which GPU to let empty for a claim that waits on fragmented capacity.

A claim for a large partition or a whole GPU can wait although the cluster has room in total,
because a few small partitions sit on every GPU that could hold it. Nothing here moves anyone:
the controller only keeps new claims off one GPU (``controller.clearing``) so that it empties
as its pods end. This module decides which GPU, from the controller's snapshot alone:

- a GPU is every device of one pool carved from one physical GPU (the whole GPU, its MIG
  partitions, its share device: they carry the GPU's ``uuid`` or, for partitions,
  ``parentUUID``);
- a GPU is a candidate for a claim when the claim cannot be allocated now, but could on that
  GPU's node once the claims holding that GPU's devices (its holders) were gone, and the
  allocation found then uses a device of that GPU but not all of them (a shared GPU is one
  device that the waiting claim and the small shares would both use: no candidate);
- candidates are ranked by ``Candidate.score``: fewest holders, then the least memory they
  hold, then the holders that have run longest (of work of similar length, what has run
  longest has least left; nothing in the API says how long a pod will run).

The devices to steer new claims from are the GPU's devices the waiting claim would not use,
so a NoSchedule taint on them never keeps the waiting claim itself off (no toleration has to
be added to it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from flexgpu.driver.allocation.allocator import allocate
from flexgpu.driver.allocation.model import DeviceClass, Node, ResourceClaim, ResourceSlice
from flexgpu.driver.allocation.pools import SliceIndex
from flexgpu.driver.allocation.selectors import SelectorCache
from flexgpu.driver.allocation.state import AllocatedState, DeviceId, allocated_state

# Attributes naming the physical GPU a device is carved from, most specific first: a MIG
# partition's own ``uuid`` is the partition's, its ``parentUUID`` the GPU's.
GPU_ATTRIBUTES = ("parentUUID", "uuid")


@dataclass(frozen=True)
class Gpu:
    """One physical GPU as the slices show it."""

    node: str
    driver: str
    pool: str
    uuid: str
    devices: tuple[DeviceId, ...]  # in slice order

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.driver, self.pool, self.uuid)


@dataclass(frozen=True)
class Candidate:
    gpu: Gpu
    holders: tuple[str, ...]  # claim keys, sorted
    held_memory: Fraction  # bytes of memory capacity of the devices the holders hold
    youngest_holder_age_s: float  # how long the most recently allocated holder has held it
    keep_free: tuple[DeviceId, ...]  # the devices the waiting claim would take
    steer: tuple[DeviceId, ...]  # the GPU's other devices: keep new claims off these

    @property
    def score(self) -> tuple[int, Fraction, float, tuple[str, str, str]]:
        """Lower is better: fewest holders, least memory held, longest-running holders,
        then the GPU's identity so that equal GPUs are chosen the same way every pass."""
        return (len(self.holders), self.held_memory, -self.youngest_holder_age_s, self.gpu.key)


def _gpu_uuid(slc: ResourceSlice, index: int) -> str | None:
    attributes = slc.devices[index].attributes
    for name in GPU_ATTRIBUTES:
        for key in (name, f"{slc.driver}/{name}"):
            value = attributes.get(key)
            if value is not None and value.kind == "string" and value.value:
                return str(value.value)
    return None


def gpus_on_node(node: Node, index: SliceIndex) -> list[Gpu]:
    """The GPUs the node can allocate from, in slice order; devices that name no GPU (other
    drivers' devices) are left out."""
    found: dict[tuple[str, str, str], list[DeviceId]] = {}
    for pool in index.pools(node):
        if not pool.usable:
            continue
        for slc in pool.device_slices:
            for i, device in enumerate(slc.devices):
                uuid = _gpu_uuid(slc, i)
                if uuid is not None:
                    key = (pool.driver, pool.name, uuid)
                    found.setdefault(key, []).append((pool.driver, pool.name, device.name))
    return [Gpu(node.name, d, p, u, tuple(devs)) for (d, p, u), devs in found.items()]


def _memory(slices: Sequence[ResourceSlice]) -> dict[DeviceId, Fraction]:
    sizes: dict[DeviceId, Fraction] = {}
    for slc in slices:
        for device in slc.devices:
            cap = device.capacity.get("memory") or device.capacity.get(f"{slc.driver}/memory")
            if cap is not None:
                sizes[(slc.driver, slc.pool, device.name)] = cap.value
    return sizes


@dataclass
class ClearingInputs:
    """The snapshot the choice is made over, and what is derived from it once per pass."""

    slices: Sequence[ResourceSlice]
    classes: Mapping[str, DeviceClass]
    claims: Sequence[ResourceClaim]
    nodes: Sequence[Node]
    # Seconds since each allocated claim was allocated (claim key -> age); missing: 0.
    holder_ages: Mapping[str, float]
    index: SliceIndex | None = None
    selectors: SelectorCache | None = None
    state: AllocatedState | None = None
    memory: dict[DeviceId, Fraction] | None = None

    def prepared(self) -> ClearingInputs:
        if self.index is None:
            self.index = SliceIndex(list(self.slices))
        if self.selectors is None:
            self.selectors = SelectorCache()
        if self.state is None:
            self.state = allocated_state(self.claims)
        if self.memory is None:
            self.memory = _memory(self.slices)
        return self


def candidates(
    claim: ResourceClaim,
    inputs: ClearingInputs,
    usable_nodes: Iterable[str] | None = None,
    *,
    exclude: Iterable[tuple[str, str, str]] = (),
) -> list[Candidate]:
    """The GPUs whose holders, once gone, would let ``claim`` be allocated there, best first.
    ``usable_nodes``: the nodes the claim's pod may use (None: all); ``exclude``: GPUs (by
    ``Gpu.key``) already being cleared for other claims."""
    inputs = inputs.prepared()
    assert inputs.index is not None and inputs.state is not None and inputs.memory is not None
    allowed = None if usable_nodes is None else set(usable_nodes)
    skip = set(exclude)
    found: list[Candidate] = []
    for node in inputs.nodes:
        if allowed is not None and node.name not in allowed:
            continue
        for gpu in gpus_on_node(node, inputs.index):
            if gpu.key in skip:
                continue
            holders = sorted({h for d in gpu.devices for h in inputs.state.holders.get(d, ())})
            if not holders or claim.key in holders:
                continue
            candidate = _candidate_on(claim, inputs, node, gpu, holders)
            if candidate is not None:
                found.append(candidate)
    return sorted(found, key=lambda c: c.score)


def _candidate_on(
    claim: ResourceClaim, inputs: ClearingInputs, node: Node, gpu: Gpu, holders: list[str]
) -> Candidate | None:
    assert inputs.state is not None and inputs.memory is not None
    without = allocated_state(inputs.claims, skip=holders)
    verdict = allocate(
        [claim],
        node,
        inputs.slices,
        inputs.classes,
        without,
        selectors=inputs.selectors,
        index=inputs.index,
    )
    if not verdict.allocatable:
        return None
    chosen = {(c.driver, c.pool, c.device) for c in verdict.devices[0]}
    keep = tuple(d for d in gpu.devices if d in chosen)
    if not keep:
        return None  # it fits there, but not on this GPU: clearing it would not help
    steer = tuple(d for d in gpu.devices if d not in chosen)
    if not steer:
        # The claim would take every device of the GPU (a shared GPU is one device): a taint
        # would keep the waiting claim off as well.
        return None
    held = {d for d in gpu.devices if inputs.state.holders.get(d)}
    return Candidate(
        gpu=gpu,
        holders=tuple(holders),
        held_memory=sum((inputs.memory.get(d, Fraction(0)) for d in held), Fraction(0)),
        youngest_holder_age_s=min(inputs.holder_ages.get(h, 0.0) for h in holders),
        keep_free=keep,
        steer=steer,
    )


def steering_limit(total_gpus: int, share: float) -> int:
    """How many GPUs may be steered at once: ``share`` of all GPUs, rounded down, so the
    bound is never exceeded (a share below one GPU's steers none)."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"clearing share {share}: must be between 0 and 1")
    return int(total_gpus * share + 1e-9)


def count_gpus(nodes: Sequence[Node], index: SliceIndex) -> int:
    return sum(len(gpus_on_node(node, index)) for node in nodes)
