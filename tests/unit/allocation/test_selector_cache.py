"""A shared SelectorCache evaluates each expression once per device and keeps errors."""

from __future__ import annotations

import pytest
from allocation_builders import DRIVER, device, pool_slices

from driver.allocation import allocator
from driver.allocation.allocator import SelectorCache
from driver.allocation.cel import SelectorError


def test_results_and_errors_are_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = allocator.evaluate

    def counting(expression: str, activation: object) -> object:
        calls.append(expression)
        return real(expression, activation)  # type: ignore[arg-type]

    monkeypatch.setattr(allocator, "evaluate", counting)
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
