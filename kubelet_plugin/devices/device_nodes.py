"""The device nodes a prepared device hands its container: ``/dev/nvidia<minor>`` for a GPU,
and for a MIG device also the ``/dev/nvidia-caps`` nodes of its GPU instance and compute
instance, which the driver checks before it lets a process use the partition.

The plugin sees the node's devices under its driver root (``<root>/dev``); the container
runtime, on the host, under the host's driver root. Each node is given with its type, major and
minor, so the runtime needs no host file to stat (MIG capability nodes may not exist on the
host until someone creates them; the runtime makes them in the container)."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from flexgpu.driver.cdi import DeviceNode

log = logging.getLogger(__name__)

# Needed by every CUDA process besides its GPU's node. With NVIDIA's generator running, they
# come with the driver's edits instead.
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
MIG_MINORS = Path("proc/driver/nvidia-caps/mig-minors")
CAPS_DEVICE = "nvidia-caps"


class DeviceNodes:
    def __init__(
        self,
        root: Path = Path("/"),
        host_root: Path | None = None,
        *,
        with_control_nodes: bool = True,
        proc_root: Path = Path("/"),
    ) -> None:
        self.root = root
        self.host_root = host_root if host_root is not None else root
        self.with_control_nodes = with_control_nodes
        # As strings: every prepared device stats its nodes, and pathlib joins cost more.
        self._dev = os.fspath(root / "dev")
        self._host_dev = os.fspath(self.host_root / "dev")
        # The driver's procfs is not namespaced: the container's /proc shows it too.
        self._proc_roots = [root] if root == proc_root else [root, proc_root]

    def gpu(self, minor: int | None) -> tuple[DeviceNode, ...]:
        names = [f"nvidia{minor}"] if minor is not None else []
        if self.with_control_nodes:
            names += CONTROL_NODES
        return tuple(n for n in (self._node(name) for name in names) if n is not None)

    def mig(
        self, gpu_minor: int | None, gpu_instance: int, compute_instance: int | None
    ) -> tuple[DeviceNode, ...]:
        nodes = list(self.gpu(gpu_minor))
        if gpu_minor is None:
            return tuple(nodes)
        caps = [f"gpu{gpu_minor}/gi{gpu_instance}/access"]
        if compute_instance is not None:
            caps.append(f"gpu{gpu_minor}/gi{gpu_instance}/ci{compute_instance}/access")
        minors = self._mig_minors()
        if not minors:
            # No driver here (a simulated node): nothing to hand out.
            log.debug("no MIG capability minors in %s", self._minors_files())
            return tuple(nodes)
        for cap in caps:
            minor = minors.get(cap)
            if minor is None:
                log.warning("no MIG capability minor for %s in %s", cap, self._minors_files())
                continue
            node = self._node(f"{CAPS_DEVICE}/nvidia-cap{minor}") or self._caps_node(minor)
            if node is not None:
                nodes.append(node)
        return tuple(nodes)

    def _node(self, name: str) -> DeviceNode | None:
        try:
            st = os.stat(f"{self._dev}/{name}")
        except OSError:
            return None
        if not stat.S_ISCHR(st.st_mode):
            return None
        return DeviceNode(
            f"/dev/{name}",
            f"{self._host_dev}/{name}",
            os.major(st.st_rdev),
            os.minor(st.st_rdev),
        )

    def _caps_node(self, minor: int) -> DeviceNode | None:
        """A capability node the host has not created yet: described by numbers alone."""
        major = self._char_major(CAPS_DEVICE)
        if major is None:
            log.warning(
                "no %s major in /proc/devices: MIG capability %d left out", CAPS_DEVICE, minor
            )
            return None
        return DeviceNode(f"/dev/{CAPS_DEVICE}/nvidia-cap{minor}", None, major, minor)

    def _minors_files(self) -> list[Path]:
        return [root / MIG_MINORS for root in self._proc_roots]

    def _mig_minors(self) -> dict[str, int]:
        for path in self._minors_files():
            try:
                text = path.read_text()
            except OSError:
                continue
            return _parse_minors(text.splitlines())
        return {}

    def _char_major(self, name: str) -> int | None:
        for root in self._proc_roots:
            try:
                lines = (root / "proc/devices").read_text().splitlines()
            except OSError:
                continue
            in_char = False
            for line in lines:
                in_char = (in_char or line.startswith("Character")) and not line.startswith("Block")
                number, _, device = line.strip().partition(" ")
                if in_char and device == name and number.isdigit():
                    return int(number)
        return None


def _parse_minors(lines: Sequence[str]) -> dict[str, int]:
    """``gpu0/gi1/access 21`` lines, as /proc/driver/nvidia-caps/mig-minors lists them."""
    minors = {}
    for line in lines:
        cap, _, number = line.strip().rpartition(" ")
        if cap and number.isdigit():
            minors[cap] = int(number)
    return minors
