"""CDI spec rendering for prepared claims (pure: no file I/O here).

One spec file per claim, ``<vendor>-<class>_<claimUID>.json``, holding one CDI device per
allocated device, named ``<claimUID>-<device>`` (``-<shareID>`` added for a share of a shared
GPU). The kubelet hands a container only the CDI devices of the requests it names, so a
container that names one request of a claim gets that request's devices and no others.

Each CDI device carries its own device nodes and one environment variable whose name is its
own (``FLEXGPU_DEVICE_<claim UID>_<device>``), so a container that uses several claims sees
every claim's devices: no variable is set by two claims with different values. The edits every
GPU container needs (the NVIDIA driver's libraries and programs, hooks, control device nodes)
come from NVIDIA's generator at plugin start and sit at spec level, applied once per spec; they
set ``NVIDIA_VISIBLE_DEVICES=void``, as every spec does, so an NVIDIA runtime hook on the node
adds nothing of its own and CDI alone decides what a container gets.

Each request of the claim also gets a CDI device of its own, ``<claimUID>_metadata_<request>``,
that mounts the request's device metadata file (KEP-5304, driver/device_metadata.py) read-only
where the KEP says a container finds it. The kubelet hands it with the request's first device,
so a container sees the files of the requests it names and no others. (Device names are DNS
labels, which hold no ``_``: the two kinds of name never meet.)
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flexgpu.driver.names import CDI_CLASS, CDI_KIND, CDI_VENDOR

ENV_VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
# The NVIDIA runtime's value for "inject nothing": CDI already did.
VISIBLE_DEVICES_VOID = "void"
ENV_DEVICE_PREFIX = "FLEXGPU_DEVICE_"
ENV_MPS_PIPE = "CUDA_MPS_PIPE_DIRECTORY"
ENV_MPS_THREADS = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
ENV_MPS_PINNED = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"

# Specs written before one CDI device per allocated device (read when rebuilding state).
LEGACY_ENV_CLAIM_NAMESPACE = "FLEXGPU_CLAIM_NAMESPACE"
LEGACY_ENV_CLAIM_NAME = "FLEXGPU_CLAIM_NAME"
LEGACY_ENV_DEVICES = "FLEXGPU_DEVICES"
LEGACY_ENV_TIME_SLICE = "FLEXGPU_TIME_SLICE"

_SPEC_FILE = re.compile(
    rf"^{re.escape(CDI_VENDOR)}-{re.escape(CDI_CLASS)}_(?P<uid>[0-9A-Za-z-]{{1,64}})\.json$"
)
_ENV_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_]")
_CDI_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")


@dataclass(frozen=True)
class DeviceNode:
    """A device node as CDI hands it to the runtime. With major and minor given the runtime
    does not stat the host path, which only exists on the host."""

    path: str  # inside the container
    host_path: str | None = None  # on the host, where it differs from ``path``
    major: int | None = None
    minor: int | None = None

    def edit(self) -> dict[str, Any]:
        node: dict[str, Any] = {"path": self.path}
        if self.host_path and self.host_path != self.path:
            node["hostPath"] = self.host_path
        if self.major is not None and self.minor is not None:
            node.update(type="c", major=self.major, minor=self.minor)
        return node


@dataclass(frozen=True)
class CdiDevice:
    """What one allocated device (or one share of a shared GPU) hands its container."""

    device_name: str
    uuid: str  # GPU or MIG device UUID, as NVML reports it
    device_nodes: tuple[DeviceNode, ...] = ()
    share_id: str | None = None
    # Sharing settings for this device: MPS limits and folders, the time-slice it runs under.
    env: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[tuple[str, str], ...] = ()  # (host path, container path)
    time_slice: str | None = None

    def with_sharing(
        self,
        env: Mapping[str, str],
        mounts: Sequence[tuple[str, str]],
        time_slice: str | None,
    ) -> CdiDevice:
        return CdiDevice(
            self.device_name,
            self.uuid,
            self.device_nodes,
            self.share_id,
            {**self.env, **env},
            tuple(mounts),
            time_slice,
        )


@dataclass(frozen=True)
class MetadataMount:
    """One request's device metadata file: where it is on the host, where the container reads
    it."""

    request: str  # the base request name
    host_path: str
    container_path: str


# Read-only, and nothing in a JSON file is to be executed, set-uid or a device.
METADATA_MOUNT_OPTIONS = ("ro", "bind", "nosuid", "nodev", "noexec")


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


def cdi_device_name(claim_uid: str, device_name: str, share_id: str | None = None) -> str:
    """The CDI device of one allocated device: ``<claimUID>-<device>[-<shareID>]``."""
    name = f"{claim_uid}-{device_name}" + (f"-{share_id}" if share_id else "")
    return _CDI_NAME_UNSAFE.sub("_", name)


def cdi_device_id(claim_uid: str, device_name: str, share_id: str | None = None) -> str:
    """Fully qualified CDI name the runtime resolves: ``gpu.flexgpu.dev/claim=<name>``."""
    return f"{CDI_KIND}={cdi_device_name(claim_uid, device_name, share_id)}"


def metadata_device_name(claim_uid: str, request: str) -> str:
    """The CDI device that mounts one request's metadata file: ``<claimUID>_metadata_<request>``."""
    return _CDI_NAME_UNSAFE.sub("_", f"{claim_uid}_metadata_{request}")


def metadata_device_id(claim_uid: str, request: str) -> str:
    return f"{CDI_KIND}={metadata_device_name(claim_uid, request)}"


def metadata_requests(spec: Mapping[str, Any], claim_uid: str) -> list[str]:
    """The requests whose metadata files a spec of ours mounts (none in specs of releases
    before device metadata)."""
    prefix = f"{claim_uid}_metadata_"
    names = [str(d.get("name", "")) for d in spec.get("devices", [])]
    return sorted(n[len(prefix) :] for n in names if n.startswith(prefix))


def device_env_name(claim_uid: str, device_name: str, share_id: str | None = None) -> str:
    """The one variable a CDI device sets: its name is as unique as the device."""
    return (
        ENV_DEVICE_PREFIX
        + _ENV_NAME_UNSAFE.sub("_", cdi_device_name(claim_uid, device_name, share_id)).upper()
    )


def device_env_value(claim: ClaimIdentity, device: CdiDevice, boot_id: str = "") -> str:
    """``uuid=GPU-...;claim=<ns>/<name>;claimUID=<uid>;device=gpu-0[;share=<id>]
    [;timeSlice=Long][;boot=<boot id>]``: what the container got from this device, readable by
    people and by a rebuild of lost state. The boot id (the node's, which every container can
    read in /proc/sys/kernel/random/boot_id anyway) tells a rebuild after a power loss that a
    surviving spec is of an earlier boot, whose MIG instances and MPS daemons are gone."""
    parts = [
        ("uuid", device.uuid),
        ("claim", f"{claim.namespace}/{claim.name}"),
        ("claimUID", claim.uid),
        ("device", device.device_name),
    ]
    if device.share_id:
        parts.append(("share", device.share_id))
    if device.time_slice:
        parts.append(("timeSlice", device.time_slice))
    if boot_id:
        parts.append(("boot", boot_id))
    return ";".join(f"{k}={v}" for k, v in parts)


def parse_device_env_value(value: str) -> dict[str, str]:
    fields = {}
    for part in value.split(";"):
        key, sep, text = part.partition("=")
        if sep:
            fields[key] = text
    return fields


def minimum_cdi_version(spec: Mapping[str, Any]) -> str:
    """The oldest spec version that holds what the spec uses, so older runtimes read it:
    0.5.0 for device names starting with a digit (claim UIDs often do) and device nodes with
    a host path, 0.4.0 for typed mounts, 0.6.0 for annotations, 0.7.0 for extra GIDs."""
    edits = [spec.get("containerEdits") or {}]
    edits += [d.get("containerEdits") or {} for d in spec.get("devices", [])]
    if any(e.get("additionalGids") or e.get("intelRdt") for e in edits):
        return "0.7.0"
    if spec.get("annotations") or any(d.get("annotations") for d in spec.get("devices", [])):
        return "0.6.0"
    if any(str(d.get("name", ""))[:1].isdigit() for d in spec.get("devices", [])) or any(
        n.get("hostPath") for e in edits for n in e.get("deviceNodes") or []
    ):
        return "0.5.0"
    if any(m.get("type") for e in edits for m in e.get("mounts") or []):
        return "0.4.0"
    return "0.3.0"


def common_edits(driver_edits: Mapping[str, Any] | None) -> dict[str, Any]:
    """The spec-level edits: the NVIDIA driver's (from NVIDIA's generator), with the NVIDIA
    runtime told to add nothing."""
    edits = json.loads(json.dumps(dict(driver_edits or {})))  # a deep copy
    env = [e for e in edits.get("env") or [] if not str(e).startswith(f"{ENV_VISIBLE_DEVICES}=")]
    edits["env"] = [*env, f"{ENV_VISIBLE_DEVICES}={VISIBLE_DEVICES_VOID}"]
    return {k: v for k, v in edits.items() if v}


def render_claim_spec(
    claim: ClaimIdentity,
    devices: Sequence[CdiDevice],
    driver_edits: Mapping[str, Any] | None = None,
    boot_id: str = "",
    metadata: Sequence[MetadataMount] = (),
) -> dict[str, Any]:
    """The spec for one claim: one CDI device per allocated device, one per request that
    mounts its metadata file, the NVIDIA driver's edits at spec level; ``boot_id`` names the
    boot it is written in (device_env_value)."""
    cdi_devices = []
    for device in devices:
        own = device_env_name(claim.uid, device.device_name, device.share_id)
        env = {own: device_env_value(claim, device, boot_id), **device.env}
        edits: dict[str, Any] = {"env": [f"{k}={v}" for k, v in env.items()]}
        if device.device_nodes:
            edits["deviceNodes"] = [n.edit() for n in device.device_nodes]
        if device.mounts:
            edits["mounts"] = [
                {"hostPath": host, "containerPath": path, "options": ["rbind", "rw"]}
                for host, path in device.mounts
            ]
        cdi_devices.append(
            {
                "name": cdi_device_name(claim.uid, device.device_name, device.share_id),
                "containerEdits": edits,
            }
        )
    for mount in metadata:
        cdi_devices.append(
            {
                "name": metadata_device_name(claim.uid, mount.request),
                "containerEdits": {
                    "mounts": [
                        {
                            "hostPath": mount.host_path,
                            "containerPath": mount.container_path,
                            "options": list(METADATA_MOUNT_OPTIONS),
                        }
                    ]
                },
            }
        )
    spec: dict[str, Any] = {
        "kind": CDI_KIND,
        "devices": cdi_devices,
        "containerEdits": common_edits(driver_edits),
    }
    spec["cdiVersion"] = minimum_cdi_version(spec)
    return spec


def with_driver_edits(
    spec: Mapping[str, Any], driver_edits: Mapping[str, Any] | None
) -> dict[str, Any]:
    """A claim's spec with the spec-level edits of another driver install: what regenerating
    a prepared claim's spec after a driver change writes. The devices (device nodes, the
    claim's own variables and mounts) stay as they were."""
    result: dict[str, Any] = json.loads(json.dumps(dict(spec)))  # a deep copy
    result["containerEdits"] = common_edits(driver_edits)
    result["cdiVersion"] = minimum_cdi_version(result)
    return result


def spec_env(spec: Mapping[str, Any]) -> dict[str, str]:
    """Every variable a spec of ours sets, its devices' and its own (used to rebuild state
    after a lost checkpoint)."""
    env: dict[str, str] = {}
    edits = [d.get("containerEdits", {}) for d in spec.get("devices", [])]
    for item in [e for edit in edits for e in edit.get("env", [])] + list(
        (spec.get("containerEdits") or {}).get("env", [])
    ):
        key, _, value = str(item).partition("=")
        env.setdefault(key, value)
    return env


def encode_spec(spec: Mapping[str, Any]) -> bytes:
    return json.dumps(spec, indent=2, sort_keys=True).encode() + b"\n"
