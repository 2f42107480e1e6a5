"""What this version of the driver can carry out, beyond what the config's schema describes.

The ``gpu.flexgpu.dev/v1alpha1`` schema keeps room for settings that prepare cannot apply yet
(a MIG device shared by time-slicing or MPS). Admission and prepare both call
``unsupported_settings`` on every parsed config (through ``driver.config_resolution``), so a
config that prepare would refuse is already refused when the claim is created, with the same
text. Pure: no I/O.
"""

from __future__ import annotations

from driver.opaque_config import (
    ConfigProblem,
    MigConfig,
    OpaqueConfig,
    SharingStrategy,
    show_value,
)


def unsupported_settings(config: OpaqueConfig) -> list[ConfigProblem]:
    """The settings of a valid ``config`` that prepare cannot apply; ``[]`` if none. Each
    problem names the field (from the root of ``parameters``), the value and what is
    allowed."""
    if isinstance(config, MigConfig):
        strategy = config.effective_sharing.strategy
        if strategy is not SharingStrategy.EXCLUSIVE:
            # Time-slicing and MPS on MIG devices need per-instance daemons; not built yet.
            detail = (
                f"{show_value(strategy.value)} is not supported on MIG devices yet; "
                f"allowed: {SharingStrategy.EXCLUSIVE.value}"
            )
            return [ConfigProblem(("sharing", "strategy"), detail)]
    return []
