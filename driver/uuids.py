"""Deterministic UUIDs for simulated GPUs, formatted like the ones NVML returns."""

from __future__ import annotations

import hashlib
import uuid


def _uuid_from(text: str) -> str:
    return str(uuid.UUID(bytes=hashlib.sha256(text.encode()).digest()[:16]))


def simulated_gpu_uuid(node_name: str, index: int) -> str:
    """``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``, the same for a node and index every time."""
    return f"GPU-{_uuid_from(f'{node_name}/gpu/{index}')}"


def simulated_mig_uuid(node_name: str, gpu_index: int, gpu_instance_id: int, serial: int) -> str:
    """``MIG-...`` for one created instance. ``serial`` counts creations on the GPU, so a
    re-created instance gets a new UUID as it does on hardware."""
    return f"MIG-{_uuid_from(f'{node_name}/gpu/{gpu_index}/gi/{gpu_instance_id}/{serial}')}"
