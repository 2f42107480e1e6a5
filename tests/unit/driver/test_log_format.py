"""Both daemons' log output: JSON lines carry level, logger, message, the claim as fields of
their own and the traceback; the level filters; bad settings are refused by name."""

from __future__ import annotations

import importlib
import io
import json
import logging
import pkgutil
from collections.abc import Iterator
from types import ModuleType

import pytest

from flexgpu.driver.log_format import claim_fields, configure_logging


@pytest.fixture(autouse=True)
def _restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_carry_claim_fields_and_tracebacks() -> None:
    out = io.StringIO()
    configure_logging("info", "json", out)
    log = logging.getLogger("flexgpu.kubelet_plugin.claims")
    log.info("prepared %d device(s)", 2, extra=claim_fields("ns", "c", "uid-1"))
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("prepare failed")
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert first["level"] == "info"
    assert first["logger"] == "flexgpu.kubelet_plugin.claims"
    assert first["message"] == "prepared 2 device(s)"
    assert (first["claim_namespace"], first["claim_name"], first["claim_uid"]) == (
        "ns",
        "c",
        "uid-1",
    )
    assert first["time"].endswith("+00:00")
    assert second["level"] == "error"
    assert "RuntimeError: boom" in second["exception"]


def test_level_filters_and_text_format() -> None:
    out = io.StringIO()
    configure_logging("WARNING", "text", out)
    logging.getLogger("flexgpu.controller").info("not shown")
    logging.getLogger("flexgpu.controller").warning("shown")
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    assert lines[0].endswith("WARNING flexgpu.controller: shown")


def test_second_call_replaces_the_handler() -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("info", "text", first)
    configure_logging("info", "json", second)
    logging.getLogger("x").info("once")
    assert first.getvalue() == ""
    assert len(second.getvalue().splitlines()) == 1


@pytest.mark.parametrize(
    ("level", "fmt", "named"), [("verbose", "json", "'verbose'"), ("info", "yaml", "'yaml'")]
)
def test_bad_settings_are_refused(level: str, fmt: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        configure_logging(level, fmt, io.StringIO())


def _flexgpu_modules() -> list[ModuleType]:
    modules = []
    for package_name in ("flexgpu.driver", "flexgpu.kubelet_plugin", "flexgpu.controller"):
        package = importlib.import_module(package_name)
        for found in pkgutil.walk_packages(package.__path__, f"{package_name}."):
            modules.append(importlib.import_module(found.name))
    return modules


def test_every_daemon_logger_is_under_flexgpu_and_follows_the_log_level() -> None:
    """Each module's logger is named under ``flexgpu`` (getLogger(__name__) since the packages
    import as flexgpu.*), none pins a level of its own, so --log-level reaches all of them."""
    modules = _flexgpu_modules()
    loggers = {
        (module.__name__, value.name)
        for module in modules
        for value in vars(module).values()
        if isinstance(value, logging.Logger)
    }
    assert len(loggers) > 20  # the walk found the daemons' modules
    assert [pair for pair in loggers if not pair[1].startswith("flexgpu.")] == []
    configure_logging("error", "text", io.StringIO())
    assert {name: logging.getLogger(name).getEffectiveLevel() for _, name in loggers} == {
        name: logging.ERROR for _, name in loggers
    }
