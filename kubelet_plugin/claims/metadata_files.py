"""Device metadata files (KEP-5304) on the node: what each prepared request's containers read
about their devices (driver/device_metadata.py renders them).

One folder per claim, ``<data dir>/dra-device-metadata/<claim UID>/``, one file per request,
``<request>/metadata.json``, replaced atomically. The claim's CDI spec mounts each file
read-only where the KEP says a container finds it (driver/cdi.py), so the files must exist
before the spec names them: prepare writes them after the devices exist and before the spec.
The folder is listed in the claim's record (``created.metadata_dir``) before anything is
written, so undo (unprepare, a failed or repeated prepare, start-up reconcile) removes it
wherever prepare got to, and start-up removes folders that no record owns.

Folders are keyed by UID, not by namespace and name as the upstream helper keys its own: a
claim deleted and created again under its name while the old one is still being unprepared
gets a folder of its own. The host path is what the container runtime mounts, so the data dir
must be the same path on the host and in the plugin's container, as the chart mounts it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Final

from flexgpu.driver.atomic_file import atomic_write_bytes
from flexgpu.driver.cdi import CdiDevice, MetadataMount
from flexgpu.driver.claim_results import AllocatedDevice
from flexgpu.driver.device_metadata import (
    MetadataClaim,
    MetadataDevice,
    container_path,
    device_attributes,
    encode_metadata,
    render_metadata,
)
from flexgpu.kubelet_plugin.claims.claim_source import ClaimView
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices

log = logging.getLogger(__name__)

FOLDER: Final = "dra-device-metadata"
FILE: Final = "metadata.json"
# What the API allows in a claim UID and a request name (a DNS label): never a path of its own.
_PATH_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,62}$")


def request_metadata(
    devices: NodeDevices,
    claim: ClaimView,
    ours: Sequence[AllocatedDevice],
    cdi_devices: Sequence[CdiDevice],
) -> dict[str, tuple[str, list[MetadataDevice]]]:
    """Base request -> (the request as the allocation names it, its devices' metadata), in
    the allocation's order. A device's UUID is the one its CDI device hands over (an
    on-demand MIG device's exists only once prepare made it)."""
    uuids = {(c.device_name, c.share_id): c.uuid for c in cdi_devices}
    out: dict[str, tuple[str, list[MetadataDevice]]] = {}
    for allocated in ours:
        attributes = device_attributes(
            devices.attributes(allocated.device) or {},
            uuid=uuids.get((allocated.device, allocated.share_id)),
            share_id=allocated.share_id,
            consumed=allocated.consumed_capacity if allocated.share_id else None,
        )
        _, entries = out.setdefault(allocated.base_request, (allocated.request, []))
        entries.append(MetadataDevice(allocated.pool, allocated.device, attributes))
    return out


class MetadataFiles:
    """The folders under ``root`` (``<data dir>/dra-device-metadata``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._root = os.fspath(root)

    def claim_dir(self, claim_uid: str) -> str:
        return f"{self._root}/{_part(claim_uid, 'claim UID')}"

    def request_file(self, claim_uid: str, request: str) -> str:
        return f"{self.claim_dir(claim_uid)}/{_part(request, 'request name')}/{FILE}"

    def write(
        self,
        devices: NodeDevices,
        claim: ClaimView,
        ours: Sequence[AllocatedDevice],
        cdi_devices: Sequence[CdiDevice],
    ) -> list[MetadataMount]:
        """Writes one file per request of the claim's devices here; returns the mounts that
        hand them to containers. The caller has recorded ``claim_dir`` in the claim's
        record."""
        identity = MetadataClaim(claim.uid, claim.namespace, claim.name, claim.pod_claim_name)
        mounts = []
        for base, (request, entries) in request_metadata(devices, claim, ours, cdi_devices).items():
            path = self.request_file(claim.uid, base)
            data = encode_metadata(render_metadata(identity, request, entries))
            # As the CDI spec: data synced, the rename not (a lost rename follows a reboot,
            # after which start-up drops the claim's record and this folder with it).
            atomic_write_bytes(path, data, sync_directory=False)
            mounts.append(MetadataMount(base, path, container_path(identity, request)))
        return mounts

    def remove(self, path: str, claim_uid: str) -> bool:
        """Removes a claim's folder as its record names it; whether there was one. A path
        that is not a claim folder of this kind is left alone, whatever a record says (a
        warning says so): undo must not fail on it, nor delete what is not ours."""
        folder = Path(path)
        if folder.name != claim_uid or folder.parent.name != FOLDER:
            log.warning("not removing %s: not claim %s's device metadata folder", path, claim_uid)
            return False
        try:
            shutil.rmtree(folder)
        except FileNotFoundError:
            return False
        return True

    def remove_unowned(self, owners: Collection[str]) -> list[str]:
        """Removes the folders of claims not in ``owners`` (UIDs); returns their names."""
        removed = []
        with contextlib.suppress(FileNotFoundError):
            for name in sorted(os.listdir(self._root)):
                if name in owners:
                    continue
                path = self.root / name
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                removed.append(name)
        return removed


def _part(name: str, what: str) -> str:
    if not _PATH_PART.match(name):
        raise ValueError(f"{what} {name!r} is not a DNS label; no metadata file is named after it")
    return name
