"""A node's GPUs and what each claim holds there, in GPU-equivalents: what
``driver.allocation.node_clearing`` chooses over, built from slices and claims.

A claim's share of a node is the sum over the devices it was allocated there:

- a whole GPU (or any device that is not one of the two below): 1;
- a MIG partition: its memory slices of the GPU's eight (``placementSize``: a 1g.10gb
  partition 1/8, a 3g.40gb 4/8), since memory slices are what a partition takes from other
  partitions of the GPU;
- a share of a shared GPU: the memory it consumed over the GPU's memory (without consumed
  memory, the whole GPU: nothing says it leaves room).

A node's GPU count is the physical GPUs its pools of ``driver`` publish
(``clearing.gpus_on_node``), so a node whose GPUs are all partitioned counts the same as one
publishing whole GPUs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Final

from flexgpu.driver.allocation.clearing import gpus_on_node
from flexgpu.driver.allocation.model import Device, Node, ResourceClaim
from flexgpu.driver.allocation.node_clearing import GroupNode, NodeHolder
from flexgpu.driver.allocation.pools import SliceIndex
from flexgpu.driver.allocation.state import DeviceId
from flexgpu.driver.mig_catalog import MEMORY_SLICES

_WHOLE: Final = Fraction(1)


def _attribute(driver: str, device: Device, name: str) -> object:
    for key in (name, f"{driver}/{name}"):
        value = device.attributes.get(key)
        if value is not None:
            return value.value
    return None


def _memory(driver: str, device: Device) -> Fraction | None:
    cap = device.capacity.get("memory") or device.capacity.get(f"{driver}/memory")
    return cap.value if cap is not None else None


def _devices(node: Node, index: SliceIndex, driver: str) -> dict[DeviceId, Device]:
    found: dict[DeviceId, Device] = {}
    for pool in index.pools(node):
        if pool.driver != driver or not pool.usable:
            continue
        for slc in pool.device_slices:
            for device in slc.devices:
                found[(pool.driver, pool.name, device.name)] = device
    return found


def _share(driver: str, device: Device, consumed_memory: Fraction | None, shared: bool) -> Fraction:
    if _attribute(driver, device, "type") == "mig":
        size = _attribute(driver, device, "placementSize")
        if isinstance(size, int) and 0 < size <= MEMORY_SLICES:
            return Fraction(size, MEMORY_SLICES)
        return _WHOLE
    if shared:
        total = _memory(driver, device)
        if consumed_memory is not None and total:
            return min(_WHOLE, consumed_memory / total)
    return _WHOLE


def group_nodes(
    nodes: Sequence[Node],
    claims: Sequence[ResourceClaim],
    index: SliceIndex,
    holder_ages: Mapping[str, float],
    driver: str,
) -> list[GroupNode]:
    """Every node of ``nodes`` with at least one GPU of ``driver``, with its holders (claim
    key order); ``holder_ages``: seconds since each claim was allocated (missing: 0)."""
    described: list[GroupNode] = []
    for node in nodes:
        gpus = sum(1 for g in gpus_on_node(node, index) if g.driver == driver)
        if gpus == 0:
            continue
        devices = _devices(node, index, driver)
        held: dict[str, Fraction] = {}
        for claim in claims:
            for result in claim.allocation or ():
                device = devices.get((result.driver, result.pool, result.device))
                if device is None or result.admin_access:
                    continue
                consumed = None
                if result.consumed_capacity is not None:
                    quantity = result.consumed_capacity.get("memory")
                    consumed = quantity.value if quantity is not None else None
                share = _share(driver, device, consumed, result.share_id is not None)
                held[claim.key] = held.get(claim.key, Fraction(0)) + share
        holders = tuple(
            NodeHolder(key, float(amount), holder_ages.get(key, 0.0))
            for key, amount in sorted(held.items())
        )
        described.append(GroupNode(node.name, gpus, holders))
    return described
