"""The checked-in CRD (crds/) is what tools/gen_crds.py generates from the models, and its
schema is structural (what apiextensions.k8s.io/v1 demands)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from flexgpu.driver.node_policy import GpuMode, PolicyReason
from tools import gen_crds

CRD_FILE = "flexgpu.dev_gpunodepolicies.yaml"


def test_checked_in_crd_equals_generated() -> None:
    checked_in = (gen_crds.CRD_DIR / CRD_FILE).read_text(encoding="utf-8")
    assert checked_in == gen_crds.rendered()[CRD_FILE], "run: python tools/gen_crds.py"


def test_no_stray_crd_files() -> None:
    assert sorted(p.name for p in gen_crds.CRD_DIR.glob("*.yaml")) == sorted(gen_crds.rendered())


def test_check_mode_reports_a_stale_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(gen_crds, "CRD_DIR", tmp_path)
    (tmp_path / CRD_FILE).write_text("{}\n", encoding="utf-8")
    assert gen_crds.main(["--check"]) == 1
    assert f"stale: {CRD_FILE}" in capsys.readouterr().err
    assert gen_crds.main([]) == 0
    assert gen_crds.main(["--check"]) == 0


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((gen_crds.CRD_DIR / CRD_FILE).read_text("utf-8"))
    return loaded


def test_names_scope_version_and_columns(crd: dict[str, Any]) -> None:
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["metadata"]["name"] == "gpunodepolicies.flexgpu.dev"
    spec = crd["spec"]
    assert spec["group"] == "flexgpu.dev"
    assert spec["scope"] == "Cluster"
    assert spec["names"]["kind"] == "GpuNodePolicy"
    assert spec["names"]["plural"] == "gpunodepolicies"
    assert spec["names"]["shortNames"] == ["gnp"]
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}}
    assert version["additionalPrinterColumns"] == [
        {"name": "Priority", "type": "integer", "jsonPath": ".spec.priority"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]


def _nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _nodes(schema["items"], f"{path}[*]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _nodes(schema["additionalProperties"], f"{path}{{*}}")


def _schema(crd: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return schema


def test_schema_is_structural(crd: dict[str, Any]) -> None:
    for path, node in _nodes(_schema(crd)):
        where = path or "."
        if node.get("x-kubernetes-int-or-string"):
            assert node["anyOf"] == [{"type": "integer"}, {"type": "string"}], where
            assert "type" not in node, where
        else:
            assert node.get("type") in {"object", "array", "string", "integer", "boolean"}, where
            assert "anyOf" not in node and "oneOf" not in node and "allOf" not in node, where
        assert not {"$ref", "const", "title", "$defs", "propertyNames"} & set(node), where
        assert not ("properties" in node and "additionalProperties" in node), where
        if node.get("type") == "array":
            assert isinstance(node.get("items"), dict), where
        if "default" in node:
            assert isinstance(node["default"], str | int | bool), where
        assert "x-kubernetes-preserve-unknown-fields" not in node, where


def test_schema_covers_the_spec_and_status(crd: dict[str, Any]) -> None:
    schema = _schema(crd)
    assert schema["required"] == ["spec"]
    assert schema["properties"]["metadata"] == {"type": "object"}
    spec = schema["properties"]["spec"]["properties"]
    assert list(spec) == ["nodeSelector", "priority", "gpus", "sharing", "health"]
    assert spec["priority"]["default"] == 0
    entry = spec["gpus"]["items"]
    assert entry["required"] == ["selector", "mode"]
    assert entry["properties"]["mode"]["enum"] == [m.value for m in GpuMode]
    assert entry["properties"]["migLayout"]["additionalProperties"]["type"] == "integer"
    assert [rule["message"] for rule in entry["x-kubernetes-validations"]] == [
        "migLayout is required with mode MIG and not allowed with other modes"
    ]
    status = schema["properties"]["status"]["properties"]
    assert list(status) == ["observedGeneration", "conditions", "matchedNodes", "nodes"]
    node = status["nodes"]["additionalProperties"]
    gpu = node["properties"]["gpus"]["additionalProperties"]
    assert gpu["properties"]["reason"]["enum"] == [r.value for r in PolicyReason]
    conditions = node["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert conditions["items"]["required"] == ["type", "status", "reason", "lastTransitionTime"]
    assert conditions["items"]["properties"]["lastTransitionTime"] == {
        "format": "date-time",
        "type": "string",
    }
    quantity = spec["sharing"]["properties"]["mpsConfig"]["properties"][
        "defaultPinnedDeviceMemoryLimit"
    ]
    assert quantity["x-kubernetes-int-or-string"] is True


def test_every_list_with_cel_rules_below_it_is_bounded(crd: dict[str, Any]) -> None:
    # Unbounded lists make the apiserver's CEL cost estimate for rules below them explode.
    for path, node in _nodes(_schema(crd)):
        if node.get("type") == "array" and any(
            "x-kubernetes-validations" in sub for _, sub in _nodes(node["items"])
        ):
            assert "maxItems" in node, path


def test_converter_refuses_what_has_no_structural_form() -> None:
    with pytest.raises(gen_crds.SchemaError, match=r"\.x: anyOf of \['integer', 'object'\]"):
        gen_crds.structural(
            {
                "type": "object",
                "properties": {"x": {"anyOf": [{"type": "integer"}, {"type": "object"}]}},
            },
            {},
        )
    with pytest.raises(gen_crds.SchemaError, match=r"\.y: no type"):
        gen_crds.structural({"type": "object", "properties": {"y": {"enum": [1]}}}, {})
    with pytest.raises(gen_crds.SchemaError, match="'oneOf' has no CRD form"):
        gen_crds.structural({"oneOf": [{"type": "string"}]}, {})


# The CRD's CEL rules and the models' validators must agree: the apiserver (without the
# admission webhook) and the plugin then reject the same objects.
_SELECTORS: list[dict[str, Any]] = [
    {},
    {"all": True},
    {"indices": [0]},
    {"productName": "NVIDIA H100*"},
    {"all": True, "indices": [1]},
    {"productName": "x", "indices": [1]},
    {"productName": "x", "all": True},
    {"productName": "x", "indices": [1], "all": True},
]
_ENTRIES: list[dict[str, Any]] = [
    {"selector": {"all": True}, "mode": mode, **extra}
    for mode in ("Whole", "Shared", "MIG", "DynamicMIG")
    for extra in ({}, {"migLayout": {"1g.10gb": 7}}, {"migLayout": {}})
]
_REQUIREMENTS: list[dict[str, Any]] = [
    {"key": "gpu", "operator": operator, **extra}
    for operator in ("In", "NotIn", "Exists", "DoesNotExist")
    for extra in ({}, {"values": []}, {"values": ["a"]})
]


@pytest.mark.parametrize(
    ("model_name", "samples"),
    [
        ("GpuSelector", _SELECTORS),
        ("GpuSelection", _ENTRIES),
        ("LabelSelectorRequirement", _REQUIREMENTS),
    ],
)
def test_cel_rules_agree_with_the_models(model_name: str, samples: list[dict[str, Any]]) -> None:
    import celpy
    from pydantic import ValidationError

    from flexgpu.driver import node_policy

    model = getattr(node_policy, model_name)
    rules = [r["rule"] for r in model.model_json_schema()["x-kubernetes-validations"]]
    env = celpy.Environment()
    programs = [env.program(env.compile(rule)) for rule in rules]
    for sample in samples:
        cel_ok = all(bool(p.evaluate({"self": celpy.json_to_cel(sample)})) for p in programs)
        try:
            model.model_validate(sample)
            model_ok = True
        except ValidationError:
            model_ok = False
        assert cel_ok == model_ok, sample
