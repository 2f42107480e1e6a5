"""An NVML stand-in that lets only queries through, for listings on real machines.

Complements ``ReadOnlyBackend`` one layer down: even a backend bug cannot reach an NVML call
that changes the GPU, because only functions on an allowlist of query families are exposed.
"""

from __future__ import annotations

from typing import Any

from flexgpu.driver.backend_errors import ReadOnlyViolationError

_QUERY_PREFIXES = (
    "nvmlDeviceGet",
    "nvmlSystemGet",
    "nvmlGpuInstanceGet",
    "nvmlComputeInstanceGet",
    "nvmlDeviceIs",
)
_LIFECYCLE = frozenset({"nvmlInit", "nvmlInitWithFlags", "nvmlShutdown"})


class ReadOnlyNvml:
    """Wraps the ``pynvml`` module (or a stand-in); non-query functions raise on access."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml

    def __getattr__(self, name: str) -> Any:
        if name.startswith("nvml") and not (name in _LIFECYCLE or name.startswith(_QUERY_PREFIXES)):
            raise ReadOnlyViolationError(f"{name} refused: NVML access is read-only")
        return getattr(self._nvml, name)
