"""The checked-in JSON Schemas (driver/schemas/) are exactly what the models generate."""

from __future__ import annotations

import json

import pytest

from tools import gen_schemas


@pytest.mark.parametrize("name", ["gpuconfig.json", "migconfig.json"])
def test_checked_in_schema_equals_generated(name: str) -> None:
    checked_in = (gen_schemas.SCHEMA_DIR / name).read_text(encoding="utf-8")
    assert checked_in == gen_schemas.rendered()[name], "run: python tools/gen_schemas.py"


def test_no_stray_schema_files() -> None:
    on_disk = sorted(p.name for p in gen_schemas.SCHEMA_DIR.glob("*.json"))
    assert on_disk == sorted(gen_schemas.rendered())


def test_check_mode_reports_a_stale_file(tmp_path, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(gen_schemas, "SCHEMA_DIR", tmp_path)
    (tmp_path / "gpuconfig.json").write_text("{}\n", encoding="utf-8")
    assert gen_schemas.main(["--check"]) == 1
    assert "stale: gpuconfig.json, migconfig.json" in capsys.readouterr().err
    assert gen_schemas.main([]) == 0
    assert gen_schemas.main(["--check"]) == 0


def test_schemas_describe_the_manifest_contract() -> None:
    gpu = json.loads((gen_schemas.SCHEMA_DIR / "gpuconfig.json").read_text(encoding="utf-8"))
    mig = json.loads((gen_schemas.SCHEMA_DIR / "migconfig.json").read_text(encoding="utf-8"))
    for schema, kind in ((gpu, "GpuConfig"), (mig, "MigConfig")):
        assert schema["required"] == ["apiVersion", "kind"]
        assert schema["additionalProperties"] is False
        assert schema["properties"]["apiVersion"]["const"] == "gpu.flexgpu.dev/v1alpha1"
        kinds = schema["properties"]["kind"]
        assert kinds.get("const") == kind or kinds["enum"] == [kind, "MigDeviceConfig"]
        assert schema["$defs"]["SharingStrategy"]["enum"] == ["Exclusive", "TimeSlicing", "MPS"]
        assert all(
            d.get("additionalProperties") is False
            for n, d in schema["$defs"].items()
            if "properties" in d
        )
    assert "timeSlicingConfig" in gpu["$defs"]["GpuSharing"]["properties"]
    assert "timeSlicingConfig" not in mig["$defs"]["MigSharing"]["properties"]
    percentage = gpu["$defs"]["MpsConfig"]["properties"]["defaultActiveThreadPercentage"]
    assert {"type": "integer", "minimum": 1, "maximum": 100} in percentage["anyOf"]
