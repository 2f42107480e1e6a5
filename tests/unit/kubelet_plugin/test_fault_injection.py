"""The test-only fault seam: what each FLEXGPU_FAULT_* variable arms, and that no other shipped
module reads them."""

from __future__ import annotations

import ast
import multiprocessing
import os
import signal
from pathlib import Path

import pytest

from flexgpu.driver.backend_errors import GpuBackendError
from flexgpu.driver.sim_faults import FaultPlan
from flexgpu.kubelet_plugin.fault_injection import (
    ENV_CRASH_AT,
    ENV_FAIL,
    arm_backend_failures,
    crash_if_at,
    crash_step,
)

REPO = Path(__file__).resolve().parents[3]


def _failures(plan: FaultPlan, operation: str, calls: int) -> int:
    failed = 0
    for _ in range(calls):
        try:
            plan.check(operation)
        except GpuBackendError:
            failed += 1
    return failed


def test_the_variable_names_stay_what_the_tests_set() -> None:
    assert (ENV_FAIL, ENV_CRASH_AT) == ("FLEXGPU_FAULT_FAIL", "FLEXGPU_FAULT_CRASH_AT")


def test_fail_arms_the_next_calls_of_each_named_operation() -> None:
    plan = FaultPlan()
    arm_backend_failures(plan, {ENV_FAIL: "create_mig_device:2, set_mig_mode"})
    assert _failures(plan, "create_mig_device", 5) == 2
    assert _failures(plan, "set_mig_mode", 5) == 1
    assert _failures(plan, "destroy_mig_device", 5) == 0


def test_without_the_variable_nothing_fails() -> None:
    plan = FaultPlan()
    arm_backend_failures(plan, {})
    assert _failures(plan, "create_mig_device", 3) == 0


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("explode:2", r"^FLEXGPU_FAULT_FAIL: unknown operation 'explode'; allowed values: "),
        ("create_mig_device:0", r"^FLEXGPU_FAULT_FAIL: count of create_mig_device .* got '0'$"),
    ],
)
def test_a_bad_fail_entry_stops_start_up_naming_the_variable(spec: str, says: str) -> None:
    with pytest.raises(GpuBackendError, match=says):
        arm_backend_failures(FaultPlan(), {ENV_FAIL: spec})


def test_crash_step_is_the_named_step_or_none() -> None:
    assert crash_step({}) is None
    assert crash_step({ENV_CRASH_AT: ""}) is None
    assert crash_step({ENV_CRASH_AT: "early-ready"}) == "early-ready"


def test_crash_if_at_kills_only_at_the_armed_step() -> None:
    crash_if_at(None, "after-prepare-started")
    crash_if_at("after-cdi-written", "after-prepare-started")

    def child() -> None:
        crash_if_at("after-cdi-written", "after-cdi-written")
        os._exit(3)  # not killed

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(30)
    assert process.exitcode == -signal.SIGKILL


def _names_a_fault_variable_in_code(source: str) -> bool:
    """Whether a string in the code (not a docstring, which may name them) holds one."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return any(
        isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and "FLEXGPU_FAULT_" in node.value
        and id(node) not in docstrings
        for node in ast.walk(tree)
    )


def test_no_other_shipped_module_reads_the_fault_variables() -> None:
    readers = [
        str(path.relative_to(REPO))
        for package in ("driver", "kubelet_plugin", "controller")
        for path in sorted((REPO / package).rglob("*.py"))
        if _names_a_fault_variable_in_code(path.read_text())
    ]
    assert readers == ["kubelet_plugin/fault_injection.py"]
