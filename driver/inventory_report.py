"""Human-readable tables of a node inventory, for the ``flexgpu inventory`` command."""

from __future__ import annotations

from collections.abc import Sequence

from flexgpu.driver.inventory import NodeInventory
from flexgpu.driver.names import gpu_device_name, mig_device_name


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(header, widths, strict=True))]
    lines += [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    ]
    return [line.rstrip() for line in lines]


def _mig_state(capable: bool, current: bool | None, pending: bool | None) -> str:
    if not capable:
        return "-"
    text = "enabled" if current else "disabled"
    if pending is not None and pending != current:
        text += " (pending " + ("enabled" if pending else "disabled") + ")"
    return text


def gpu_table(inventory: NodeInventory) -> str:
    header: tuple[str, ...] = ("DEVICE", "PRODUCT", "MEMORY", "SMS", "CC", "PCI", "NUMA", "NVLINK")
    header += ("MIG", "HEALTH", "UUID")
    rows = []
    for entry in inventory.gpus:
        gpu = entry.gpu
        mode = gpu.mig_mode
        rows.append(
            (
                gpu_device_name(gpu.index),
                gpu.product_name,
                f"{gpu.memory_mib} MiB",
                str(gpu.multiprocessors) if gpu.multiprocessors is not None else "?",
                gpu.cuda_compute_capability,
                gpu.pci_bus_id,
                str(gpu.numa_node) if gpu.numa_node is not None else "-",
                gpu.nvlink_domain,
                _mig_state(
                    gpu.mig_capable, mode.current if mode else None, mode.pending if mode else None
                ),
                str(gpu.health),
                gpu.uuid,
            )
        )
    return "\n".join(_table(header, rows))


def mig_table(inventory: NodeInventory) -> str:
    """Every possible MIG placement of every MIG-capable GPU, with what occupies it now."""
    header = ("DEVICE", "PROFILE", "ID", "PLACEMENT", "MEMORY", "SMS", "MAX", "IN USE BY")
    rows = []
    for entry in inventory.gpus:
        for profile in entry.mig_profiles:
            for placement in profile.placements:
                existing = next(
                    (
                        d
                        for d in entry.mig_devices
                        if d.profile_id == profile.profile_id and d.placement == placement
                    ),
                    None,
                )
                rows.append(
                    (
                        mig_device_name(entry.gpu.index, profile.name, placement.start),
                        profile.name,
                        str(profile.profile_id),
                        f"{placement.start}:{placement.size}",
                        f"{profile.memory_mib} MiB",
                        str(profile.multiprocessors),
                        str(profile.max_instances),
                        (existing.uuid or f"GI {existing.gpu_instance_id}") if existing else "",
                    )
                )
    if not rows:
        return "no MIG-capable GPUs"
    return "\n".join(_table(header, rows))
