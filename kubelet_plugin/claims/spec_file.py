"""A claim's CDI spec on disk: rendered (driver/cdi.py) and written crash-safely."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flexgpu.driver.atomic_file import atomic_write_bytes
from flexgpu.driver.cdi import (
    CdiDevice,
    ClaimIdentity,
    MetadataMount,
    encode_spec,
    render_claim_spec,
)


def write_claim_spec(
    path: str,
    identity: ClaimIdentity,
    devices: Sequence[CdiDevice],
    *,
    driver_edits: Mapping[str, Any],
    boot_id: str,
    metadata: Sequence[MetadataMount],
) -> None:
    """Writes the claim's spec; nothing when none of its devices is ours (a spec needs at
    least one device)."""
    if not devices:
        return
    spec = render_claim_spec(identity, devices, driver_edits, boot_id, metadata)
    # The container runtime reads the spec without a checksum, so its data is synced: a
    # rename that survives a power loss never names a torn spec. The directory is not: a
    # lost rename only follows a reboot, after which the kubelet prepares again.
    atomic_write_bytes(path, encode_spec(spec), sync_directory=False)
