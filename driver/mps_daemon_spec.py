"""What an MPS control daemon for a claim's MIG devices is started with. Pure: no I/O.

A whole GPU's daemon serves every claim on that GPU and takes the GPU in exclusive-process
compute mode. A MIG device cannot work that way: compute mode is a setting of the parent GPU,
whose other partitions belong to other claims, so it is left alone (NVIDIA's DRA driver sets
EXCLUSIVE_PROCESS only on the full GPUs of a claim, never on a MIG device's parent). Instead
each claim whose MIG devices are shared with MPS gets a daemon of its own, as NVIDIA's driver
does: started with ``CUDA_VISIBLE_DEVICES`` naming the MIG devices' UUIDs, in UUID order, and
given the claim's limits as the daemon's defaults. The daemon is keyed by the first of those
UUIDs: its folders and its pod are named after it, and no other claim holds that device.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexgpu.driver.gpu_model import MpsDaemon

__all__ = ["MIG_UUID_PREFIX", "MigMpsDaemonSpec", "serves_mig"]

MIG_UUID_PREFIX = "MIG-"


@dataclass(frozen=True)
class MigMpsDaemonSpec:
    """One daemon for a claim's MIG devices.

    ``device_uuids`` are sorted: NVIDIA's per-device keys index the devices in UUID order, and
    the daemon (so every client) enumerates them in ``CUDA_VISIBLE_DEVICES`` order, so index
    ``i`` of a limit is ordinal ``i`` for the client. ``pinned_memory_mib`` holds one entry per
    device in that order (``None``: no limit on that device)."""

    parent_index: int  # the parent GPU of the first device: its lock guards the daemon
    device_uuids: tuple[str, ...]
    active_thread_percentage: int | None = None
    pinned_memory_mib: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if not self.device_uuids or list(self.device_uuids) != sorted(set(self.device_uuids)):
            raise ValueError(f"device UUIDs must be distinct and sorted: {self.device_uuids}")
        if not all(u.startswith(MIG_UUID_PREFIX) for u in self.device_uuids):
            raise ValueError(f"not MIG device UUIDs: {self.device_uuids}")
        if self.pinned_memory_mib and len(self.pinned_memory_mib) != len(self.device_uuids):
            raise ValueError("one pinned-memory entry per device, or none")

    @property
    def key(self) -> str:
        """The UUID the daemon is known by (folders, pod name, records)."""
        return self.device_uuids[0]

    @property
    def visible_devices(self) -> str:
        """``CUDA_VISIBLE_DEVICES`` of the daemon."""
        return ",".join(self.device_uuids)

    def pinned_by_uuid(self) -> dict[str, int]:
        return {
            uuid: mib
            for uuid, mib in zip(self.device_uuids, self.pinned_memory_mib, strict=False)
            if mib is not None
        }

    def control_commands(self) -> list[str]:
        """What a started daemon is told on its control pipe, as NVIDIA's daemon template
        tells it: the defaults every client of the claim's devices gets. Defaults apply to
        the MPS servers the daemon starts from then on; a fresh daemon has none yet."""
        commands = []
        if self.active_thread_percentage is not None:
            commands.append(f"set_default_active_thread_percentage {self.active_thread_percentage}")
        for uuid, mib in self.pinned_by_uuid().items():
            commands.append(f"set_default_device_pinned_mem_limit {uuid} {mib}M")
        return commands


def serves_mig(daemon: MpsDaemon) -> bool:
    """Whether a running daemon is a MIG device daemon: its ``gpu_uuid`` is then its key,
    a MIG device UUID, and ``gpu_index`` the index of that device's parent GPU."""
    return daemon.gpu_uuid.startswith(MIG_UUID_PREFIX)
