"""What an MPS daemon pod of this plugin says about itself: its GPU, whether it serves MIG
devices and what it was started with (its annotations), and how it ended."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from flexgpu.driver.mps_daemon_spec import MIG_UUID_PREFIX, MigMpsDaemonSpec
from flexgpu.kubelet_plugin.agents.mps_pod_spec import (
    GPU_INDEX_LABEL,
    GPU_UUID_ANNOTATION,
    MIG_SPEC_ANNOTATION,
)

log = logging.getLogger(__name__)

TERMINATED = frozenset({"Succeeded", "Failed"})


def gpu_index_of(pod: Mapping[str, Any]) -> int:
    return int(pod["metadata"]["labels"][GPU_INDEX_LABEL])


def pod_serves_mig(pod: Mapping[str, Any]) -> bool:
    uuid = (pod["metadata"].get("annotations") or {}).get(GPU_UUID_ANNOTATION, "")
    return str(uuid).startswith(MIG_UUID_PREFIX)


def mig_spec_of(pod: Mapping[str, Any]) -> MigMpsDaemonSpec | None:
    """What a MIG device daemon's pod was started with; ``None`` for a whole GPU's pod (or an
    annotation no plugin wrote)."""
    text = (pod.get("metadata", {}).get("annotations") or {}).get(MIG_SPEC_ANNOTATION)
    if not text:
        return None
    try:
        data = json.loads(text)
        return MigMpsDaemonSpec(
            parent_index=int(data["parentIndex"]),
            device_uuids=tuple(data["devices"]),
            active_thread_percentage=data.get("activeThreadPercentage"),
            pinned_memory_mib=tuple(data.get("pinnedMemoryMiB") or ()),
        )
    except (ValueError, KeyError, TypeError):
        log.warning("MPS daemon pod %s: unreadable %s", pod["metadata"]["name"], text)
        return None


def pod_phase(pod: Mapping[str, Any]) -> str:
    return str(pod.get("status", {}).get("phase", "Pending"))


def ended_how(pod: Mapping[str, Any]) -> str:
    for status in pod.get("status", {}).get("containerStatuses", []) or []:
        done = (status.get("state") or {}).get("terminated")
        if done:
            return f"exit code {done.get('exitCode')}, {done.get('reason', 'no reason given')}"
    return f"pod phase {pod_phase(pod)}"
