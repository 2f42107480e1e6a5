"""Typed errors raised by every GPU backend, so callers react to the kind of failure.

No backend lets a library-specific exception (such as an NVML error) escape; it is translated
into one of these, keeping the library's code and message for diagnostics.
"""

from __future__ import annotations


class GpuBackendError(Exception):
    """Base class. ``code`` carries the underlying library's error code when there is one."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class NotSupportedError(GpuBackendError):
    """The GPU, driver or backend does not support the operation (e.g. MIG on a T4)."""


class InsufficientResourcesError(GpuBackendError):
    """The GPU has no room: overlapping MIG placement or the profile's instance limit reached."""


class InUseError(GpuBackendError):
    """The target is busy: MIG mode change with instances present, instance with processes."""


class NotFoundError(GpuBackendError):
    """No such GPU, MIG instance or profile."""


class PermissionDeniedError(GpuBackendError):
    """The process lacks the privileges the operation needs."""


class InvalidArgumentError(GpuBackendError):
    """The request is malformed (unknown profile id, placement not offered for the profile)."""


class GpuLostError(GpuBackendError):
    """The GPU stopped responding (fell off the bus); it needs a reset or a reboot."""


class BackendUnavailableError(GpuBackendError):
    """The backend cannot run at all on this machine (NVML library or kernel driver missing)."""


class ReadOnlyViolationError(PermissionDeniedError):
    """A mutating call was made through a backend wrapped read-only."""
