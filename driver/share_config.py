"""The ``share`` block of a ``GpuConfig``: settings of a fraction of a shared GPU.

A fraction's ``compute`` capacity request is what the scheduler counts against the GPU
(consumable capacity) and, by default, also the MPS active thread percentage its processes
get. ``computeLimit`` lets the processes use more of the GPU's SMs than the request reserves
(a burstable fraction): the scheduler still counts the request, MPS enforces the limit, and
memory stays a hard limit. The block is a flexgpu setting with no counterpart in NVIDIA's
``sharing`` block, so it sits beside ``sharing`` rather than inside it: a manifest written
for NVIDIA's driver stays valid as it is. Pure: no I/O.
"""

from __future__ import annotations

from typing import Final

from pydantic import Field

from flexgpu.driver.validation_messages import StrictModel

__all__ = ["COMPUTE_LIMIT_ALLOWED", "ShareConfig"]

COMPUTE_LIMIT_ALLOWED: Final = "an integer from 1 to 100, at least the request's compute"


class ShareConfig(StrictModel):
    """Settings of a fraction of a shared GPU (devices of shared-gpu.flexgpu.dev)."""

    computeLimit: int | None = Field(
        default=None,
        ge=1,
        le=100,
        description=(
            "Percent of the GPU's SMs the fraction's processes may use (the MPS active thread "
            "percentage), at least the compute the request reserves. The scheduler still "
            "counts the request; above it the processes use SMs other fractions leave idle. "
            "Unset: the limit is the request (or, without one, in proportion to memory)"
        ),
    )
