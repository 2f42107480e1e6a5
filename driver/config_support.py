"""What this version of the driver can carry out, beyond what the config's schema describes.

The ``gpu.flexgpu.dev/v1alpha1`` schema keeps room for settings that prepare cannot apply yet
(a MIG device shared by MPS). Admission and prepare both call
``unsupported_settings`` on every parsed config (through ``driver.config_resolution``), so a
config that prepare would refuse is already refused when the claim is created, with the same
text. Pure: no I/O.

``unsupported_on_device`` does the same for what depends on the device a config lands on;
admission knows that from the request's DeviceClass, prepare from the allocation.
"""

from __future__ import annotations

from flexgpu.driver.opaque_config import (
    ConfigProblem,
    GpuConfig,
    MigConfig,
    OpaqueConfig,
    SharingStrategy,
    show_value,
)
from flexgpu.driver.user_text import shorten


def unsupported_settings(config: OpaqueConfig) -> list[ConfigProblem]:
    """The settings of a valid ``config`` that prepare cannot apply; ``[]`` if none. Each
    problem names the field (from the root of ``parameters``), the value and what is
    allowed."""
    if isinstance(config, MigConfig):
        strategy = config.effective_sharing.strategy
        # TimeSlicing needs nothing set: a MIG device's processes are time-sliced by default
        # and it has no interval of its own (NVIDIA's driver accepts it and sets nothing).
        # MPS needs a control daemon per MIG device; not built yet.
        if strategy is SharingStrategy.MPS:
            detail = (
                f"{show_value(strategy.value)} is not supported on MIG devices yet; "
                f"allowed: {SharingStrategy.EXCLUSIVE.value}, "
                f"{SharingStrategy.TIME_SLICING.value}"
            )
            return [ConfigProblem(("sharing", "strategy"), detail)]
    return []


def unsupported_on_device(
    config: OpaqueConfig, device_type: str, request: str
) -> list[ConfigProblem]:
    """The settings of ``config`` that prepare cannot apply to a device of ``device_type``
    (``gpu``, ``mig`` or ``shared``) allocated for ``request``; ``[]`` if none."""
    if device_type == "shared" and isinstance(config, GpuConfig):
        strategy = config.effective_sharing.strategy
        if strategy is SharingStrategy.TIME_SLICING:
            # A share's limits are MPS limits; time-slicing would lift them for every share.
            detail = (
                f"{show_value(strategy.value)} is not supported on a shared GPU (request "
                f'"{shorten(request)}"; a share is enforced with MPS); allowed: '
                f"{SharingStrategy.EXCLUSIVE.value}, {SharingStrategy.MPS.value}"
            )
            return [ConfigProblem(("sharing", "strategy"), detail)]
    return []
