"""What the DRA gRPC service asks of the code that prepares claims, free of protobuf types."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ClaimRef:
    """A ResourceClaim as the kubelet names it. The object may already be deleted."""

    namespace: str
    name: str
    uid: str


@dataclass(frozen=True)
class PreparedDevice:
    """One device handed to the container runtime for a claim."""

    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...] = ()
    # Empty means the device serves every request of the claim.
    request_names: tuple[str, ...] = ()
    # Set for devices allocated with allowMultipleAllocations (shared GPUs).
    share_id: str | None = None


@dataclass(frozen=True)
class PrepareResult:
    """Outcome for one claim: its devices, or an error (then the devices are ignored)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""

    @classmethod
    def failed(cls, error: str) -> PrepareResult:
        return cls(error=error or "failed")


@dataclass(frozen=True)
class UnprepareResult:
    """Outcome for one claim; an empty error is success."""

    error: str = ""


class DraDriver(Protocol):
    """Prepares and unprepares claims on this node.

    Called from gRPC worker threads. Results are keyed by claim UID; a claim left out of the
    result, or an exception, is reported to the kubelet as a per-claim error and retried.
    Unpreparing an unknown claim must succeed.
    """

    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]: ...

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, UnprepareResult]: ...
