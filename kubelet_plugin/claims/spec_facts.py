"""What a CDI spec of ours says about its claim, and whether it was written in this boot.

Start-up rebuilds lost claim records from the CDI specs that survive (startup_reconcile.py).
A spec survives a reboot where the CDI folder is not a tmpfs (``cdiDir`` is a chart value),
and what it names need not exist any more: a MIG instance, an MPS daemon, a time-slice
setting of the earlier boot. So a spec is trusted only when it was written in this boot: each
device's variable carries the boot id the spec was written in (``boot=<id>``, cdi.py); a spec
of an earlier release has none, and then its modification time must not be older than the
boot. A spec of an earlier boot is never used to rebuild a record; it is deleted as an orphan,
and the kubelet's next prepare of its claim starts afresh.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from flexgpu.driver.cdi import (
    ENV_DEVICE_PREFIX,
    ENV_VISIBLE_DEVICES,
    LEGACY_ENV_CLAIM_NAME,
    LEGACY_ENV_CLAIM_NAMESPACE,
    LEGACY_ENV_DEVICES,
    LEGACY_ENV_TIME_SLICE,
    claim_uid_from_spec_file,
    metadata_requests,
    parse_device_env_value,
    spec_env,
)

PROC_STAT: Final = Path("/proc/stat")


@dataclass(frozen=True)
class SpecDevice:
    name: str
    share_id: str | None
    uuid: str
    time_slice: str | None


@dataclass(frozen=True)
class SpecFacts:
    """What a spec of ours says about its claim: identity, devices, sharing (env), boot."""

    namespace: str
    name: str
    devices: tuple[SpecDevice, ...]
    env: dict[str, str]
    legacy: bool  # written before one CDI device per allocated device
    # The boot id the spec was written in; "" in specs of releases that did not record it.
    boot_id: str = ""
    # The requests whose device metadata files it mounts (none before device metadata).
    metadata_requests: tuple[str, ...] = ()


def spec_facts(path: Path) -> SpecFacts | None:
    try:
        document = json.loads(path.read_bytes())
        env = spec_env(document)
        uid = claim_uid_from_spec_file(path.name)
        metadata = tuple(metadata_requests(document, uid)) if uid else ()
    except (OSError, ValueError, AttributeError):
        return None  # unreadable: no runtime can use it either; removed as an orphan
    devices = []
    claim = ""
    boots = set()
    for key in sorted(env):
        if key.startswith(ENV_DEVICE_PREFIX):
            fields = parse_device_env_value(env[key])
            claim = claim or fields.get("claim", "")
            boots.add(fields.get("boot", ""))
            devices.append(
                SpecDevice(
                    fields.get("device", ""),
                    fields.get("share"),
                    fields.get("uuid", ""),
                    fields.get("timeSlice"),
                )
            )
    if devices:
        namespace, _, name = claim.partition("/")
        # Devices that disagree (a spec pieced together from two boots) name no boot.
        boot_id = boots.pop() if len(boots) == 1 else ""
        return SpecFacts(
            namespace,
            name,
            tuple(devices),
            env,
            legacy=False,
            boot_id=boot_id,
            metadata_requests=metadata,
        )
    # One CDI device for the whole claim, identity and GPUs in shared variables.
    names = [n for n in env.get(LEGACY_ENV_DEVICES, "").split(",") if n]
    uuids = [u for u in env.get(ENV_VISIBLE_DEVICES, "").split(",") if u and u != "void"]
    slice_ = env.get(LEGACY_ENV_TIME_SLICE)
    legacy = [SpecDevice(n, None, "", slice_) for n in names]
    legacy += [SpecDevice("", None, u, None) for u in uuids]
    return SpecFacts(
        env.get(LEGACY_ENV_CLAIM_NAMESPACE, ""),
        env.get(LEGACY_ENV_CLAIM_NAME, ""),
        tuple(legacy),
        env,
        legacy=True,
    )


def read_boot_time(path: Path = PROC_STAT) -> float | None:
    """When this boot began (seconds since the epoch, the kernel's ``btime``); None when
    the file cannot say."""
    try:
        for line in path.read_text(encoding="ascii").splitlines():
            key, _, value = line.partition(" ")
            if key == "btime":
                return float(value.strip())
    except (OSError, ValueError):
        return None
    return None


def written_before_this_boot(
    path: Path, facts: SpecFacts, boot_id: str, boot_time: float | None
) -> bool:
    """Whether the spec at ``path`` is of an earlier boot. Its own boot id decides; without
    one (an earlier release wrote it), a modification time older than the boot does. Where
    neither can tell, the spec is taken for this boot's, as releases before this check did."""
    if facts.boot_id:
        return facts.boot_id != boot_id
    if boot_time is None:
        return False
    try:
        return os.stat(path).st_mtime < boot_time
    except OSError:
        return False
