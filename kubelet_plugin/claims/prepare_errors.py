"""Why a claim cannot be prepared: the message goes to the kubelet (and the pod's Events)."""

from __future__ import annotations


class PrepareError(Exception):
    """A claim cannot be prepared; the message goes to the kubelet (and the pod's events)."""


class HeldError(PrepareError):
    """The claim's devices are held by claims the node still has prepared (``holders``)."""

    def __init__(self, message: str, holders: tuple[str, ...]) -> None:
        super().__init__(message)
        self.holders = holders
