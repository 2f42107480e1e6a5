"""Reads what a GPU workload container reported about itself (tools/images/report.sh) from
its log as the kubelet wrote it (CRI format: ``<time> <stream> <tag> <line>``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# ENXIO: the device cgroup let the open through and no driver answered, as on a GPU node
# without a loaded kernel module. EPERM would mean the cgroup denied it.
OPEN_ALLOWED = "No such device or address"
OPEN_DENIED = "Operation not permitted"


@dataclass
class Device:
    path: str
    major: int
    minor: int
    open_result: str

    @property
    def cgroup_allows(self) -> bool:
        return self.open_result in (OPEN_ALLOWED, "opened")


@dataclass
class Report:
    seq: int
    name: str = ""
    env: dict[str, str] = field(default_factory=dict)
    devices: dict[str, Device] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    nvml: list[str] = field(default_factory=list)
    # Device metadata files (KEP-5304) by path: their content on one line, and what writing
    # to them answered ("written", or the error, e.g. "Read-only file system").
    metadata: dict[str, str] = field(default_factory=dict)
    metadata_writes: dict[str, str] = field(default_factory=dict)

    def metadata_objects(self, path: str) -> list[dict[str, Any]]:
        """The JSON objects of a metadata file, in order (one per API version)."""
        text, decoder, at = self.metadata[path], json.JSONDecoder(), 0
        objects: list[dict[str, Any]] = []
        while True:
            while at < len(text) and text[at].isspace():
                at += 1
            if at == len(text):
                return objects
            obj, at = decoder.raw_decode(text, at)
            objects.append(obj)

    @property
    def visible_devices(self) -> list[str]:
        """GPU and MIG UUIDs the container was given, sorted: NVIDIA_VISIBLE_DEVICES and the
        plugin's per-device records (``FLEXGPU_DEVICE_*=uuid=<uuid>;claim=...;device=...``),
        whichever the plugin's CDI edits set."""
        value = self.env.get("NVIDIA_VISIBLE_DEVICES", "")
        found = {v for v in value.split(",") if v and v not in ("void", "none", "all")}
        found |= {r["uuid"] for r in self.device_records if r.get("uuid")}
        return sorted(found)

    @property
    def device_records(self) -> list[dict[str, str]]:
        """The plugin's per-device variables, each split into its ``key=value`` fields."""
        return [
            {k: v for k, _, v in (f.partition("=") for f in record.split(";"))}
            for key, record in sorted(self.env.items())
            if key.startswith("FLEXGPU_DEVICE_")
        ]

    @property
    def time_slices(self) -> set[str]:
        """Time-slice intervals the container was told of (per device, or the older
        claim-wide FLEXGPU_TIME_SLICE)."""
        found = {r["timeSlice"] for r in self.device_records if r.get("timeSlice")}
        if self.env.get("FLEXGPU_TIME_SLICE"):
            found.add(self.env["FLEXGPU_TIME_SLICE"])
        return found

    def gpu_nodes(self) -> list[str]:
        """/dev/nvidia<N> nodes (per-GPU), without the control nodes."""
        return sorted(p for p in self.devices if p.removeprefix("/dev/nvidia").isdigit())


def _payload(line: str) -> str:
    # CRI log line: timestamp, stream, P(artial)/F(ull) tag, then the text.
    parts = line.split(" ", 3)
    if len(parts) == 4 and parts[1] in ("stdout", "stderr"):
        return parts[3]
    return line


def parse(log: str) -> list[Report]:
    """Every complete report in ``log``, oldest first."""
    done: list[Report] = []
    current: Report | None = None
    for raw in log.splitlines():
        line = _payload(raw)
        if not line.startswith("fgr "):
            continue
        parts = line.split(" ", 2)
        if len(parts) < 3 or not parts[1].isdigit():
            continue
        seq = int(parts[1])
        kind, _, value = parts[2].partition(" ")
        if kind == "begin":
            current = Report(seq)
        elif current is None or current.seq != seq:
            continue
        elif kind == "end":
            done.append(current)
            current = None
        elif kind == "name":
            current.name = value
        elif kind == "env":
            key, _, val = value.partition("=")
            current.env[key] = val
        elif kind == "dev":
            path, numbers, result = [*value.split(" ", 2), "", ""][:3]
            major, _, minor = numbers.partition(":")
            try:
                current.devices[path] = Device(path, int(major, 16), int(minor, 16), result)
            except ValueError:
                continue
        elif kind == "file":
            current.files.append(value)
        elif kind == "mount":
            current.mounts.append(value)
        elif kind == "nvml":
            current.nvml.append(value)
        elif kind in ("meta", "metawrite"):
            path, _, text = value.partition(" ")
            (current.metadata if kind == "meta" else current.metadata_writes)[path] = text
    return done


def latest(log: str) -> Report | None:
    reports = parse(log)
    return reports[-1] if reports else None
