"""Device health as the health gRPC service needs it, free of protobuf types."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


class HealthStatus(enum.IntEnum):
    """Values match the HealthStatus enum of the kubelet's health API."""

    UNKNOWN = 0
    HEALTHY = 1
    UNHEALTHY = 2


@dataclass(frozen=True)
class DeviceHealth:
    pool_name: str
    device_name: str
    status: HealthStatus
    # Unix seconds when the status was determined.
    last_updated: int
    message: str = ""
    # Zero lets the kubelet use its default (30 s).
    timeout_seconds: int = 0


class HealthSource(Protocol):
    """Health of every device of this driver on the node.

    subscribe() registers a callback to run (from any thread, without blocking) whenever the
    snapshot may have changed, and returns a function that removes it again.
    """

    def snapshot(self) -> Sequence[DeviceHealth]: ...

    def subscribe(self, on_change: Callable[[], None]) -> Callable[[], None]: ...
