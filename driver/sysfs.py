"""PCI topology facts NVML does not give reliably: NUMA node and PCIe root complex.

The sysfs root is injectable so tests build a fake tree.
"""

from __future__ import annotations

import os
from pathlib import Path

from flexgpu.driver.pci_address import normalize_pci_bus_id


class SysfsPci:
    def __init__(self, root: str | os.PathLike[str] = "/sys") -> None:
        self._root = Path(root)

    def _device_dir(self, bus_id: str) -> Path:
        return self._root / "bus" / "pci" / "devices" / normalize_pci_bus_id(bus_id)

    def numa_node(self, bus_id: str) -> int | None:
        """NUMA node of the device; ``None`` when unknown (sysfs reports -1 on non-NUMA hosts)."""
        try:
            value = int((self._device_dir(bus_id) / "numa_node").read_text().strip())
        except (OSError, ValueError):
            return None
        return value if value >= 0 else None

    def pcie_root(self, bus_id: str) -> str | None:
        """Root complex the device hangs off, e.g. ``pci0000:00``, as Kubernetes' pcieRoot.

        The device's sysfs entry is a link into ``/sys/devices/pciDDDD:BB/...``; the first path
        component after ``devices`` names the root.
        """
        try:
            resolved = self._device_dir(bus_id).resolve(strict=True)
        except (OSError, RuntimeError):
            return None
        parts = resolved.parts
        for i, part in enumerate(parts[:-1]):
            if part == "devices" and parts[i + 1].startswith("pci"):
                return parts[i + 1]
        return None
