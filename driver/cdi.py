"""CDI spec rendering for prepared claims (pure: no file I/O here).

One spec file per claim, ``<vendor>-<class>_<claimUID>.json``, holding one CDI device named
after the claim UID. Every device of the claim points the container at that CDI device, so a
container sees exactly the GPUs of the claims it references. The env also records claim and
device identity, which lets a restarted plugin rebuild its state from the CDI directory.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from driver.names import CDI_CLASS, CDI_KIND, CDI_VENDOR

ENV_CLAIM_UID = "FLEXGPU_CLAIM_UID"
ENV_CLAIM_NAMESPACE = "FLEXGPU_CLAIM_NAMESPACE"
ENV_CLAIM_NAME = "FLEXGPU_CLAIM_NAME"
ENV_DEVICES = "FLEXGPU_DEVICES"
ENV_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"

# Device nodes every CUDA process needs besides the per-GPU one, when the host has them.
CONTROL_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")

_SPEC_FILE = re.compile(
    rf"^{re.escape(CDI_VENDOR)}-{re.escape(CDI_CLASS)}_(?P<uid>[0-9A-Za-z-]{{1,64}})\.json$"
)


@dataclass(frozen=True)
class CdiDevice:
    """What one prepared device contributes to its claim's container edits."""

    device_name: str
    uuid: str  # GPU or MIG device UUID, as NVML reports it
    device_nodes: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ClaimIdentity:
    uid: str
    namespace: str
    name: str


def spec_file_name(claim_uid: str) -> str:
    return f"{CDI_VENDOR}-{CDI_CLASS}_{claim_uid}.json"


def claim_uid_from_spec_file(file_name: str) -> str | None:
    """The claim UID a spec file of ours belongs to; None for anyone else's file."""
    match = _SPEC_FILE.match(file_name)
    return match["uid"] if match else None


def cdi_device_id(claim_uid: str) -> str:
    """Fully qualified CDI name the runtime resolves: ``gpu.flexgpu.dev/claim=<uid>``."""
    return f"{CDI_KIND}={claim_uid}"


def minimum_cdi_version(device_names: Sequence[str]) -> str:
    # Device names that start with a digit (claim UIDs often do) need spec version 0.5.0;
    # plain env and device-node edits are in 0.3.0. Older runtimes only read what they know.
    return "0.5.0" if any(name[:1].isdigit() for name in device_names) else "0.3.0"


def render_claim_spec(
    claim: ClaimIdentity,
    devices: Sequence[CdiDevice],
    extra_env: Mapping[str, str] | None = None,
    mounts: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """The spec for one claim. ``extra_env`` and ``mounts`` (host path, container path)
    carry sharing settings: MPS limits, pipe and shared-memory folders."""
    env: dict[str, str] = {
        ENV_VISIBLE_DEVICES: ",".join(d.uuid for d in devices) or "void",
        ENV_CLAIM_UID: claim.uid,
        ENV_CLAIM_NAMESPACE: claim.namespace,
        ENV_CLAIM_NAME: claim.name,
        ENV_DEVICES: ",".join(d.device_name for d in devices),
    }
    for device in devices:
        env.update(device.env)
    env.update(extra_env or {})
    nodes: list[str] = []
    for device in devices:
        nodes += [n for n in device.device_nodes if n not in nodes]
    edits: dict[str, Any] = {"env": [f"{k}={v}" for k, v in env.items()]}
    if nodes:
        edits["deviceNodes"] = [{"path": n} for n in nodes]
    if mounts:
        edits["mounts"] = [
            {"hostPath": host, "containerPath": path, "options": ["rbind", "rw"]}
            for host, path in mounts
        ]
    return {
        "cdiVersion": minimum_cdi_version([claim.uid]),
        "kind": CDI_KIND,
        "devices": [{"name": claim.uid, "containerEdits": edits}],
    }


def host_device_nodes(gpu_minor: int | None, dev_root: Path = Path("/dev")) -> tuple[str, ...]:
    """Device nodes for one GPU that exist on this host (none on a simulated node)."""
    candidates = [f"/dev/nvidia{gpu_minor}"] if gpu_minor is not None else []
    candidates += list(CONTROL_DEVICE_NODES)
    return tuple(c for c in candidates if os.path.exists(dev_root / Path(c).relative_to("/dev")))


def spec_env(spec: Mapping[str, Any]) -> dict[str, str]:
    """The env a spec of ours sets (used to rebuild state after a lost checkpoint)."""
    env: dict[str, str] = {}
    for device in spec.get("devices", []):
        for item in device.get("containerEdits", {}).get("env", []):
            key, _, value = str(item).partition("=")
            env[key] = value
    return env


def encode_spec(spec: Mapping[str, Any]) -> bytes:
    return json.dumps(spec, indent=2, sort_keys=True).encode() + b"\n"
