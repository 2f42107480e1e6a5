"""CEL selectors: device variable shape, Kubernetes quantity/semver/string libraries, errors."""

from __future__ import annotations

import pytest

from flexgpu.driver.allocation.cel import (
    SelectorError,
    compile_selector,
    device_activation,
    evaluate,
)
from flexgpu.driver.allocation.model import parse_device

D = "gpu.example.com"
DEVICE = parse_device(
    {
        "name": "gpu-0",
        "allowMultipleAllocations": True,
        "attributes": {
            "type": {"string": "gpu"},
            "index": {"int": 3},
            "migCapable": {"bool": True},
            "driverVersion": {"version": "580.95.5"},
            "other.example.org/zone": {"string": "east"},
        },
        "capacity": {"memory": {"value": "80Gi"}, "compute": {"value": "100"}},
    }
)
ACT = device_activation(D, DEVICE)
A = f'device.attributes["{D}"]'
C = f'device.capacity["{D}"]'


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        (f'device.driver == "{D}"', True),
        ("device.allowMultipleAllocations", True),
        (f'{A}.type == "gpu" && {A}.index == 3 && {A}.migCapable', True),
        ('device.attributes["other.example.org"].zone == "east"', True),
        ('"zone" in device.attributes["unknown.example.org"]', False),
        (f"has({A}.numaNode)", False),
        (f'{C}.memory.compareTo(quantity("40Gi")) > 0', True),
        (f'{C}.memory == quantity("81920Mi")', True),
        (f'{C}.memory.isGreaterThan(quantity("80Gi"))', False),
        (f'{C}.memory.isLessThan(quantity("81Gi"))', True),
        (f'{C}.memory.sub(quantity("60Gi")).add(quantity("1Gi")) == quantity("21Gi")', True),
        (f"{C}.compute.asInteger() == 100 && {C}.compute.isInteger()", True),
        ('quantity("1.5").isInteger()', False),
        ('quantity("-1").sign() == -1', True),
        ('isQuantity("10Gi") && !isQuantity("10 Gi")', True),
        (f'{A}.driverVersion.isGreaterThan(semver("550.0.0"))', True),
        (f'{A}.driverVersion.compareTo(semver("580.95.5")) == 0', True),
        (f"{A}.driverVersion.major() == 580 && {A}.driverVersion.patch() == 5", True),
        ('semver("1.0.0-rc.1").isLessThan(semver("1.0.0"))', True),
        ('semver("1.0.0-alpha.2").isGreaterThan(semver("1.0.0-alpha.10"))', False),
        ('isSemver("1.2.3") && !isSemver("01.2.3") && isSemver("v1.2", true)', True),
        ('semver("v1.2", true) == semver("1.2.0")', True),
        (f'{A}.type.upperAscii() == "GPU" && "a,b,c".split(",").size() == 3', True),
        ('"NVIDIA H100".lowerAscii().startsWith("nvidia") && "h100".matches("^h[0-9]+$")', True),
        ('"abc".substring(1) == "bc" && "abc".indexOf("c") == 2 && "abc".charAt(0) == "a"', True),
        ('["a", "b"].join("-") == "a-b" && " x ".trim() == "x"', True),
        ('"gpu-12".find("[0-9]+") == "12"', True),
        (f"{A}.index in [1, 3] && [1, 2].all(x, x > 0)", True),
        # CEL's && and || absorb an error when the other side decides.
        (f"false && {A}.missing == 1", False),
        (f"{A}.missing == 1 || true", True),
    ],
)
def test_expressions(expression: str, expected: bool) -> None:
    assert evaluate(expression, ACT) is expected


@pytest.mark.parametrize(
    "expression",
    [
        f"{A}.numaNode == 0",  # missing attribute: a runtime error, as in the scheduler
        'device.attributes["unknown.example.org"].zone == "x"',
        'quantity("ten") == quantity("10")',
        'semver("1.2") == semver("1.2.0")',
        'quantity("1.5").asInteger() == 1',
        f'{A}.index.compareTo(quantity("1")) == 0',
        f"{A}.type",  # not a bool
    ],
)
def test_runtime_errors_raise(expression: str) -> None:
    with pytest.raises(SelectorError) as err:
        evaluate(expression, ACT)
    assert not err.value.compile_error


def test_compile_error_is_reported_and_cached() -> None:
    with pytest.raises(SelectorError) as err:
        evaluate("device.driver ==", ACT)
    assert err.value.compile_error
    assert compile_selector("device.driver ==") is compile_selector("device.driver ==")
    assert compile_selector(f'device.driver == "{D}"').program is not None


def test_unqualified_names_belong_to_the_driver_domain() -> None:
    act = device_activation("other.example.org", DEVICE)
    assert evaluate('device.attributes["other.example.org"].type == "gpu"', act)
    assert evaluate('device.attributes["other.example.org"].zone == "east"', act)
    assert not evaluate(f'"type" in device.attributes["{D}"]', act)


def test_unparseable_version_attribute_is_an_error() -> None:
    bad = parse_device({"name": "x", "attributes": {"v": {"version": "1.2"}}})
    with pytest.raises(SelectorError):
        device_activation(D, bad)
