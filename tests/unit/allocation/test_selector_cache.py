"""A shared SelectorCache evaluates each expression once per device and keeps errors."""

from __future__ import annotations

import contextlib

import pytest
from allocation_builders import DRIVER, device, pool_slices

from flexgpu.driver.allocation import selectors
from flexgpu.driver.allocation.cel import SelectorError
from flexgpu.driver.allocation.selectors import SelectorCache


def test_results_and_errors_are_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = selectors.evaluate

    def counting(expression: str, activation: object) -> object:
        calls.append(expression)
        return real(expression, activation)  # type: ignore[arg-type]

    monkeypatch.setattr(selectors, "evaluate", counting)
    (slc,) = pool_slices("n1", [device("d0", productName="H100")])
    dev = slc.devices[0]
    cache = SelectorCache()
    good = f'device.attributes["{DRIVER}"].productName == "H100"'
    bad = f'device.attributes["{DRIVER}"].missing == 1'
    for _ in range(3):
        assert cache.matches([good], DRIVER, dev, "class")
        with pytest.raises(SelectorError, match="request: selector #1 on device"):
            cache.matches([good, bad], DRIVER, dev, "request")
    assert calls == [good, bad]


def test_devices_that_agree_on_what_an_expression_reads_share_one_evaluation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    real = selectors.evaluate

    def counting(expression: str, activation: object) -> object:
        calls.append(expression)
        return real(expression, activation)  # type: ignore[arg-type]

    monkeypatch.setattr(selectors, "evaluate", counting)
    devices = [
        dev
        for i in range(6)
        for dev in pool_slices(
            f"n{i}", [device(f"d{i}", uuid=f"GPU-{i}", productName="H100" if i % 2 else "A100")]
        )[0].devices
    ]
    cache = SelectorCache()
    by_product = f'device.attributes["{DRIVER}"].productName == "H100"'
    by_memory = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("40Gi")) >= 0'
    assert [cache.matches([by_product], DRIVER, d, "class") for d in devices] == [
        False, True, False, True, False, True
    ]  # fmt: skip
    assert all(cache.matches([by_memory], DRIVER, d, "class") for d in devices)
    assert calls == [by_product, by_product, by_memory]  # one per distinct value read


@pytest.mark.parametrize(
    "expression",
    [
        # Reads the device in ways the field analysis does not follow: one evaluation per device.
        f'device.attributes["{DRIVER}"].exists(k, k == "uuid")',
        f'device.attributes["{DRIVER}"]["uuid"] == "GPU-1"',
        'device.attributes.exists(d, d == "x")',
    ],
)
def test_expressions_reading_the_device_otherwise_are_evaluated_per_device(
    monkeypatch: pytest.MonkeyPatch, expression: str
) -> None:
    calls: list[str] = []
    real = selectors.evaluate

    def counting(expr: str, activation: object) -> object:
        calls.append(expr)
        return real(expr, activation)  # type: ignore[arg-type]

    monkeypatch.setattr(selectors, "evaluate", counting)
    devices = [
        pool_slices(f"n{i}", [device(f"d{i}", uuid=f"GPU-{i}")])[0].devices[0] for i in range(3)
    ]
    cache = SelectorCache()
    for d in devices:
        with contextlib.suppress(SelectorError):
            cache.matches([expression], DRIVER, d, "class")
    assert len(calls) == 3


def test_a_missing_attribute_and_a_missing_domain_are_told_apart() -> None:
    with_domain = pool_slices("a", [device("d0", uuid="GPU-0")])[0].devices[0]
    other = pool_slices("b", [{"name": "d1", "attributes": {"other.dev/x": {"int": 1}}}])[0]
    cache = SelectorCache()
    expression = f'has(device.attributes["{DRIVER}"].productName)'
    assert not cache.matches([expression], DRIVER, with_domain, "class")
    assert not cache.matches([expression], DRIVER, other.devices[0], "class")
    direct = SelectorCache()
    for dev in (with_domain, other.devices[0]):
        assert cache.matches([expression], DRIVER, dev, "x") == direct.matches(
            [expression], DRIVER, dev, "x"
        )
