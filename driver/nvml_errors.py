"""Translation of NVML error codes into the backend's typed errors."""

from __future__ import annotations

import pynvml

from flexgpu.driver.backend_errors import (
    BackendUnavailableError,
    GpuBackendError,
    GpuLostError,
    InsufficientResourcesError,
    InUseError,
    InvalidArgumentError,
    NotFoundError,
    NotSupportedError,
    PermissionDeniedError,
)

_BY_CODE: dict[int, type[GpuBackendError]] = {
    pynvml.NVML_ERROR_NOT_SUPPORTED: NotSupportedError,
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: NotSupportedError,
    pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES: InsufficientResourcesError,
    pynvml.NVML_ERROR_IN_USE: InUseError,
    pynvml.NVML_ERROR_NOT_FOUND: NotFoundError,
    pynvml.NVML_ERROR_GPU_NOT_FOUND: NotFoundError,
    pynvml.NVML_ERROR_NO_PERMISSION: PermissionDeniedError,
    pynvml.NVML_ERROR_INVALID_ARGUMENT: InvalidArgumentError,
    pynvml.NVML_ERROR_GPU_IS_LOST: GpuLostError,
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: BackendUnavailableError,
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: BackendUnavailableError,
    pynvml.NVML_ERROR_UNINITIALIZED: BackendUnavailableError,
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: BackendUnavailableError,
    # The driver refused a structure version pynvml sent: module and driver do not match.
    pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH: BackendUnavailableError,
}


def nvml_error_name(code: int) -> str:
    for name in dir(pynvml):
        if name.startswith("NVML_ERROR_") and getattr(pynvml, name) == code:
            return name
    return f"NVML error {code}"


def error_for_code(code: int, context: str) -> GpuBackendError:
    """Typed error for an NVML return code, with the operation named in the message."""
    error_type = _BY_CODE.get(code, GpuBackendError)
    return error_type(f"{context}: {nvml_error_name(code)}", code=code)


def translate_nvml_error(exc: BaseException, context: str) -> GpuBackendError:
    """Typed error for an exception raised by ``pynvml`` (an NVMLError or a library mismatch)."""
    if isinstance(exc, pynvml.NVMLError):
        return error_for_code(int(exc.value), context)
    return BackendUnavailableError(f"{context}: {exc}")
