"""Undo of a claim record: removes what the record says prepare created or changed (CDI
spec, device metadata files, time-slice, MPS daemon, MIG instance), wherever prepare got to.
Used by unprepare, by a failed or repeated prepare, by start-up reconcile and by early
partition creation."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from flexgpu.driver.backend_errors import GpuLostError, NotFoundError
from flexgpu.driver.gpu_model import MigDevice, TimeSliceInterval
from flexgpu.driver.mps_daemon_spec import serves_mig
from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimRecord, MigInstanceRecord
from flexgpu.kubelet_plugin.claims.metadata_files import MetadataFiles
from flexgpu.kubelet_plugin.claims.mps_daemons import MpsDaemons
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices

log = logging.getLogger(__name__)


class ClaimUndo:
    """``mps`` is asked each time: main.py may hand the daemons to pods of their own after
    the preparer was built. ``step`` names the crash-test steps (preparer._step)."""

    def __init__(
        self,
        devices: NodeDevices,
        mps: Callable[[], MpsDaemons],
        step: Callable[[str, str], None],
        metadata: MetadataFiles,
    ) -> None:
        self.devices = devices
        self._mps = mps
        self._step = step
        self._metadata = metadata

    @property
    def mps(self) -> MpsDaemons:
        return self._mps()

    def undo(self, record: ClaimRecord, all_records: Iterable[ClaimRecord]) -> list[str]:
        """Removes everything the record says was (or may have been) created or changed, and
        says what it did. Shared state (an MPS daemon, a time-slice setting) is released only
        when no other claim still uses it. The caller holds the locks of the record's GPUs."""
        others = [r for r in all_records if r.uid != record.uid]
        done: list[str] = []
        path = record.created.cdi_spec_path
        if path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                done.append(f"removed CDI spec {Path(path).name}")
        # After the spec: no spec ever names a file that is gone. Not listed in ``done``: like
        # the record, the folder is the plugin's own file in its data dir, which outlives a
        # reboot, and "what was left set" after one is about what containers were handed.
        folder = record.created.metadata_dir
        if folder:
            self._metadata.remove(folder, record.uid)
        backend = self.devices.backend
        for index in record.created.time_slices:
            shared = any(index in r.created.time_slices for r in others)
            if not shared and ignore_lost_gpu(
                backend.set_time_slice, int(index), TimeSliceInterval.DEFAULT
            ):
                done.append(f"reset time-slice of gpu-{index} to Default")
        # A MIG device's daemon holds it: stopped before its partition is destroyed.
        stopped = self._stop_mig_daemon(record, others)
        if stopped:
            done += stopped
            self._step("undo-mps-stopped", record.uid)
        for instance in record.created.mig_instances:
            try:
                destroyed = self.destroy_partition(instance)
            except (GpuLostError, NotFoundError) as err:
                log.warning("cannot restore GPU state: %s", err)
                destroyed = ""
            if destroyed:
                done.append(f"destroyed MIG instance {destroyed}")
        share = record.created.mps_share
        if share is None or share.mig:
            return done
        gpu_in_use = any(
            r.created.mps_share
            and not r.created.mps_share.mig
            and r.created.mps_share.gpu_index == share.gpu_index
            for r in others
        )
        if share.gpu_index is not None and not gpu_in_use:
            running = {d.gpu_index for d in self.mps.running() if not serves_mig(d)}
            if ignore_lost_gpu(self.mps.stop, share.gpu_index) and (share.gpu_index in running):
                done.append(f"stopped the MPS daemon of gpu-{share.gpu_index}")
        return done

    def _stop_mig_daemon(self, record: ClaimRecord, others: Iterable[ClaimRecord]) -> list[str]:
        """Stops the daemon of the record's MIG devices, wherever prepare got to: keyed by one
        of their UUIDs, which the record holds once prepare knew them, and which a partition
        created before the record was completed shows on the hardware."""
        share = record.created.mps_share
        if share is None or not share.mig:
            return []
        candidates = set(share.gpu_uuids)
        for name in share.devices:
            static = self.devices.resolve(name)  # None for a partition prepare creates
            if static is not None:
                candidates.add(static.uuid)
        for instance in record.created.mig_instances:
            live = self.live_instance(instance)
            if live is not None and live.uuid is not None:
                candidates.add(live.uuid)
        # No other claim holds these devices; an admin-access claim's record might name them.
        held = {u for r in others if r.created.mps_share for u in r.created.mps_share.gpu_uuids}
        done = []
        for daemon in self.mps.running():
            ours = serves_mig(daemon) and daemon.gpu_uuid in candidates - held
            if ours and ignore_lost_gpu(self.mps.stop_mig, daemon.gpu_index, daemon.gpu_uuid):
                done.append(f"stopped the MPS daemon of MIG device {daemon.gpu_uuid}")
        return done

    def live_instance(self, record: MigInstanceRecord) -> MigDevice | None:
        """The instance a record names: by UUID once prepare recorded it, else (a crash
        before that) by profile and placement."""
        if record.parent_index is None:
            return None
        try:
            instances = self.devices.backend.list_mig_devices(record.parent_index)
        except (GpuLostError, NotFoundError):
            return None
        for instance in instances:
            if record.uuid is not None:
                match = instance.uuid == record.uuid
            else:
                match = instance.placement.start == record.placement_start and (
                    record.profile_id is None or instance.profile_id == record.profile_id
                )
            if match:
                return instance
        return None

    def destroy_partition(self, record: MigInstanceRecord) -> str:
        """Destroys the recorded instance (found as ``live_instance`` finds it). Returns
        what it destroyed, or ''."""
        instance = self.live_instance(record)
        if instance is None or record.parent_index is None:
            return ""
        self.devices.backend.destroy_mig_device(record.parent_index, instance.gpu_instance_id)
        what = (
            f"{record.profile}@{record.placement_start} on gpu-{record.parent_index}"
            f" ({instance.uuid})"
        )
        log.info("destroyed MIG instance %s", what)
        return what


def ignore_lost_gpu(call: Callable[..., object], *args: object) -> bool:
    """Whether the call succeeded. A GPU that is gone cannot be reset; what the claim changed
    went with it."""
    try:
        call(*args)
    except (GpuLostError, NotFoundError) as err:
        log.warning("cannot restore GPU state: %s", err)
        return False
    return True
