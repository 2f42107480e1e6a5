"""Fault injection, for tests only: the one place the plugin reads the ``FLEXGPU_FAULT_*``
environment variables, and the only way product code gets a fault. With neither set (as in
every real deployment: the chart sets neither) nothing here does anything.

- ``FLEXGPU_FAULT_FAIL=<operation>[:<count>],...``: on the simulated backend only, the next
  ``count`` calls (default 1) of each named backend operation (a ``GpuBackend`` method, e.g.
  ``create_mig_device``) raise a ``GpuBackendError``. An unknown operation or a count below 1
  stops the plugin at start, naming the entry. The NVML backend ignores it.
- ``FLEXGPU_FAULT_CRASH_AT=<step>``: the plugin SIGKILLs itself when a prepare or unprepare
  reaches the named step (``ClaimPreparerImpl``'s steps, e.g. ``after-prepare-started``,
  ``early-ready``, and the binding watch's ``tenant-decided``), exactly as an OOM kill or a
  node shutdown would interrupt it, so the crash tests can check what start-up reconcile
  makes of each step. Any backend.

The variables are read when the plugin starts; the parser of the first lives with the scripted
failures it sets (``driver/sim_faults.py``), which the core library keeps free of environment
reading.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flexgpu.driver.sim_faults import FaultPlan

log = logging.getLogger(__name__)

ENV_FAIL = "FLEXGPU_FAULT_FAIL"
ENV_CRASH_AT = "FLEXGPU_FAULT_CRASH_AT"


def arm_backend_failures(plan: FaultPlan, environ: Mapping[str, str] = os.environ) -> None:
    """Scripts ``FLEXGPU_FAULT_FAIL``'s failures into a simulated backend's ``plan``; a bad
    entry raises ``GpuBackendError`` naming the variable, the entry and what is allowed."""
    from flexgpu.driver.backend_errors import GpuBackendError
    from flexgpu.driver.sim_faults import parse_fault_spec

    try:
        faults = parse_fault_spec(environ.get(ENV_FAIL, ""))
    except ValueError as err:
        raise GpuBackendError(f"{ENV_FAIL}: {err}") from None
    for operation, count in faults:
        plan.fail_next(operation, count)


def crash_step(environ: Mapping[str, str] = os.environ) -> str | None:
    """The step ``FLEXGPU_FAULT_CRASH_AT`` names, or None (unset or empty: never crash)."""
    return environ.get(ENV_CRASH_AT) or None


def crash_if_at(crash_at: str | None, step: str) -> None:
    """SIGKILLs this process when ``step`` is the one it was armed with (``crash_step``)."""
    if crash_at is not None and crash_at == step:
        log.warning("fault injection: SIGKILL at %s", step)
        os.kill(os.getpid(), signal.SIGKILL)
