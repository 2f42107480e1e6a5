"""Scripted failures for the simulated backend: make the next N calls of an operation fail."""

from __future__ import annotations

import threading
from collections.abc import Callable

from flexgpu.driver.backend import GpuBackend
from flexgpu.driver.backend_errors import GpuBackendError

ErrorFactory = Callable[[str], GpuBackendError]


def _default_error(operation: str) -> GpuBackendError:
    return GpuBackendError(f"injected failure in {operation}")


def backend_operations() -> frozenset[str]:
    """Names of every operation of the backend interface, the ones faults can target."""
    return frozenset(GpuBackend.__abstractmethods__)


class FaultPlan:
    """Thread-safe countdown of failures per operation name."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, list[ErrorFactory]] = {}

    def fail_next(
        self, operation: str, count: int = 1, error: ErrorFactory = _default_error
    ) -> None:
        """The next ``count`` calls of ``operation`` raise ``error(operation)``."""
        allowed = backend_operations()
        if operation not in allowed:
            raise ValueError(
                f"unknown operation {operation!r}; allowed values: {', '.join(sorted(allowed))}"
            )
        if count < 1:
            raise ValueError(f"count must be at least 1, got {count}")
        with self._lock:
            self._pending.setdefault(operation, []).extend([error] * count)

    def check(self, operation: str) -> None:
        """Raise the next scripted failure for ``operation``, if any is left."""
        with self._lock:
            queue = self._pending.get(operation)
            if not queue:
                return
            factory = queue.pop(0)
        raise factory(operation)

    def clear(self) -> None:
        with self._lock:
            self._pending.clear()


def parse_fault_spec(text: str) -> list[tuple[str, int]]:
    """``create_mig_device:3,set_mig_mode`` -> [("create_mig_device", 3), ("set_mig_mode", 1)]:
    the failures a fault test asks of a plugin on the simulated backend (the plugin reads the
    text from its environment in ``kubelet_plugin/fault_injection.py``). A bad entry raises
    ValueError naming it and what is allowed."""
    plan: list[tuple[str, int]] = []
    allowed = backend_operations()
    for entry in filter(None, (e.strip() for e in text.split(","))):
        operation, _, count = entry.partition(":")
        if operation not in allowed:
            raise ValueError(
                f"unknown operation {operation!r}; allowed values: {', '.join(sorted(allowed))}"
            )
        if count and not (count.isdigit() and int(count) >= 1):
            raise ValueError(
                f"count of {operation} must be a whole number of at least 1, got {count!r}"
            )
        plan.append((operation, int(count) if count else 1))
    return plan
