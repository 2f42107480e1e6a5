"""What this version of the driver can carry out, beyond what the config's schema describes.

The ``gpu.flexgpu.dev/v1alpha1`` schema keeps ``sharing.mpsConfig.multiUser``, which no MPS
control daemon flexgpu starts can honour (docs/migrating.md says why). Admission and prepare
both call ``unsupported_settings`` on every parsed config (through
``driver.config_resolution``), so a config that prepare would refuse is already refused when
the claim is created, with the same text. Pure: no I/O.

``unsupported_on_device`` does the same for what depends on the device a config lands on;
admission knows that from the request's DeviceClass, prepare from the allocation. That
includes the ``share`` block (a fraction's own settings: only on a shared GPU) and its
``computeLimit``, which may not be below the compute the request reserves: admission checks
it against the request's ``capacity.requests.compute``, prepare against what the scheduler
granted.
"""

from __future__ import annotations

from flexgpu.driver.opaque_config import (
    ConfigProblem,
    GpuConfig,
    OpaqueConfig,
    SharingStrategy,
    show_value,
)
from flexgpu.driver.user_text import shorten

_DEVICE_WORDS = {"gpu": "a whole GPU", "mig": "a MIG device"}

# Why multiUser: true is refused, and what to do instead (sources in docs/migrating.md).
_MULTI_USER = (
    "true is not supported: NVIDIA's DRA driver has no such setting, and the MPS control "
    "daemon flexgpu starts (MPS protocol 2) has no multi-user mode: it runs one MPS server "
    "per Linux user at a time, and clients of another user wait until that server exits "
    "(only the opt-in MPS v3 interface has a --multiuser flag, which flexgpu does not run); "
    "allowed: false, or leave it out and run the claim's containers as one user"
)


def unsupported_settings(config: OpaqueConfig) -> list[ConfigProblem]:
    """The settings of a valid ``config`` that prepare cannot apply; ``[]`` if none. Each
    problem names the field (from the root of ``parameters``), the value and what is
    allowed."""
    mps = config.effective_sharing.mpsConfig
    if mps is not None and mps.multiUser:
        return [ConfigProblem(("sharing", "mpsConfig", "multiUser"), _MULTI_USER)]
    return []


def unsupported_on_device(
    config: OpaqueConfig, device_type: str, request: str, reserved_compute: int | None = None
) -> list[ConfigProblem]:
    """The settings of ``config`` that prepare cannot apply to a device of ``device_type``
    (``gpu``, ``mig`` or ``shared``) allocated for ``request``; ``[]`` if none.
    ``reserved_compute`` is the percent of SMs the request reserves on a shared GPU: what it
    asks for at admission, what the scheduler granted at prepare (``None``: not known)."""
    if isinstance(config, GpuConfig) and config.share is not None and device_type != "shared":
        return [ConfigProblem(("share",), _share_elsewhere(device_type, request))]
    if device_type == "shared" and isinstance(config, GpuConfig):
        limit = config.share.computeLimit if config.share is not None else None
        if limit is not None and reserved_compute is not None and limit < reserved_compute <= 100:
            return [
                ConfigProblem(("share", "computeLimit"), _below(limit, reserved_compute, request))
            ]
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


def _share_elsewhere(device_type: str, request: str) -> str:
    return (
        f"not supported on {_DEVICE_WORDS.get(device_type, device_type)} (request "
        f"{show_value(shorten(request))}; the block sets a fraction's limits); allowed: only on "
        "a shared GPU (shared-gpu.flexgpu.dev); an MPS client of a whole GPU is capped with "
        "sharing.mpsConfig.defaultActiveThreadPercentage"
    )


def _below(limit: int, reserved: int, request: str) -> str:
    # A limit below the request would leave reserved SMs that no process may use.
    return (
        f"{limit} is not allowed (below the {reserved} percent of SMs request "
        f"{show_value(shorten(request))} reserves); allowed: an integer from {reserved} to 100"
    )
