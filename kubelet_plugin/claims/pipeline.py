"""The path of every prepare and unprepare: named stages in order, then the preparer.

Each stage does its part around the rest of the path (``around(call, claims, next_step)``): it
may answer every claim itself without going on (the start-up gate), or go on and act on the
answer or after it (metrics, tenancy). One method serves both calls; ``Call`` says which, and
how a claim fails in it. The order is written once, where the plugin is wired (main.py).

The gate is the one stage that exists while the sockets are served and nothing else is: the
pipeline starts as the gate alone and is completed, once start-up has built the rest, with a
path that begins with the same stages, so a call held in the gate goes on along the completed
path (each step reads the path when it runs).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeAlias, TypeVar

from flexgpu.kubelet_plugin.kubeletplugin import (
    ClaimRef,
    DraDriver,
    PrepareResult,
    UnprepareResult,
)

__all__ = ["PREPARE", "UNPREPARE", "Call", "ClaimPipeline", "R", "Stage", "Step"]

# The result type of the call passing: one stage method serves prepare and unprepare.
R = TypeVar("R", PrepareResult, UnprepareResult)

# The rest of the path from a stage on: claims in, results by claim UID out.
Step: TypeAlias = Callable[[Sequence[ClaimRef]], Mapping[str, R]]

# Only reachable if a gate let a call through before the path was completed: the kubelet
# retries, as it does for a call the gate holds too long.
NOT_COMPLETE = "the plugin is still starting (its prepare path is not complete yet); retry"


@dataclass(frozen=True)
class Call(Generic[R]):
    """Which call passes (``name``: "prepare" or "unprepare"), a claim's failure in it, and
    how the preparer at the end of the path is asked."""

    name: str
    failed: Callable[[str], R]
    invoke: Callable[[DraDriver, Sequence[ClaimRef]], Mapping[str, R]]


def _unprepare_failed(error: str) -> UnprepareResult:
    return UnprepareResult(error=error)


PREPARE: Call[PrepareResult] = Call("prepare", PrepareResult.failed, lambda d, c: d.prepare(c))
UNPREPARE: Call[UnprepareResult] = Call("unprepare", _unprepare_failed, lambda d, c: d.unprepare(c))


class Stage(Protocol):
    """One named stage of the path. Called from gRPC worker threads, concurrently."""

    @property
    def name(self) -> str: ...

    def around(
        self, call: Call[R], claims: Sequence[ClaimRef], next_step: Step[R]
    ) -> Mapping[str, R]: ...


class ClaimPipeline:
    """A DraDriver that passes each call through its stages, outermost first, then the end
    (the preparer). Exceptions and per-claim errors travel back unchanged; the gRPC service
    turns them into per-claim answers."""

    def __init__(self, stages: Sequence[Stage], end: DraDriver | None = None) -> None:
        self._lock = threading.Lock()
        # Replaced whole, once (complete), so a step reads a consistent pair.
        self._path: tuple[tuple[Stage, ...], DraDriver | None] = (tuple(stages), end)

    def complete(self, stages: Sequence[Stage], end: DraDriver) -> None:
        """The whole path, once start-up has built it. It begins with the stages served
        until now, so that a call already inside one of them stays on a path of the same
        shape."""
        with self._lock:
            served, current = self._path
            if current is not None:
                raise RuntimeError("the claim pipeline is complete already")
            given = tuple(stages)
            begins = given[: len(served)]
            if len(begins) < len(served) or any(
                a is not b for a, b in zip(begins, served, strict=True)
            ):
                raise ValueError(
                    f"stages: {_names(given)} does not begin with the stages served so far; "
                    f"allowed: a path that begins with {_names(served)}"
                )
            self._path = (given, end)

    @property
    def names(self) -> tuple[str, ...]:
        """The stages' names in order, then the end's type (what the start-up log prints)."""
        stages, end = self._path
        return tuple(s.name for s in stages) + (() if end is None else (type(end).__name__,))

    @property
    def end(self) -> DraDriver | None:
        return self._path[1]

    def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, PrepareResult]:
        return self._step(PREPARE, 0)(claims)

    def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, UnprepareResult]:
        return self._step(UNPREPARE, 0)(claims)

    def _step(self, call: Call[R], index: int) -> Step[R]:
        def run(claims: Sequence[ClaimRef]) -> Mapping[str, R]:
            stages, end = self._path  # now, not when the call arrived: see the docstring
            if index < len(stages):
                return stages[index].around(call, claims, self._step(call, index + 1))
            if end is None:
                return {c.uid: call.failed(NOT_COMPLETE) for c in claims}
            return call.invoke(end, claims)

        return run


def _names(stages: Sequence[Stage]) -> str:
    return "[" + ", ".join(s.name for s in stages) + "]"
