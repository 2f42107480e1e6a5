"""A prepared claim's log line carries the claim's namespace, name and UID as fields of their
own, so JSON logs can be filtered by claim."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from flexgpu.driver.log_format import configure_logging
from flexgpu.kubelet_plugin.claims.preparer import ClaimPreparerImpl
from tests.unit.kubelet_plugin.test_preparer import ClaimTable, gpu, preparer, table

__all__ = ["preparer", "table"]


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    out = io.StringIO()
    configure_logging("info", "json", out)
    yield out
    root.handlers[:] = handlers
    root.setLevel(level)


def test_prepared_claim_is_logged_with_its_fields(
    preparer: ClaimPreparerImpl, table: ClaimTable, json_log: io.StringIO
) -> None:
    ref = table.add("c", gpu("gpu-1"))
    (result,) = preparer.prepare([ref]).values()
    assert result.error == ""
    lines = [json.loads(line) for line in json_log.getvalue().splitlines()]
    prepared = [e for e in lines if e["message"].startswith("prepared claim ns/c")]
    assert len(prepared) == 1
    assert (
        prepared[0]["claim_namespace"],
        prepared[0]["claim_name"],
        prepared[0]["claim_uid"],
    ) == ("ns", "c", "uid-c")
