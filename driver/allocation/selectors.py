"""Which devices a request may consider, as the scheduler decides it: its class's and its own
selectors (CEL over a device's attributes and capacities, results cached per device and
expression) and the taints it tolerates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from flexgpu.driver.allocation.cel import (
    DeviceTable,
    SelectorError,
    device_activation,
    device_fields,
    device_table,
    evaluate,
    field_values,
    versions_parse,
)
from flexgpu.driver.allocation.model import Device, RequestSpec

BLOCKING_TAINT_EFFECTS = frozenset({"NoSchedule", "NoExecute"})


def tainted(device: Device, spec: RequestSpec) -> bool:
    """An untolerated NoSchedule or NoExecute taint keeps the device from being allocated."""
    return any(
        t.effect in BLOCKING_TAINT_EFFECTS and not any(tol.tolerates(t) for tol in spec.tolerations)
        for t in device.taints
    )


class SelectorCache:
    """Selector results per device and expression, and the CEL ``device`` variable per device.

    CEL evaluation dominates the cost of an explanation, and the same class and request
    selectors meet the same devices again and again, so results are kept. Entries are keyed
    by the device object's identity and hold a reference to it, so an identity is never reused
    while the cache lives; a caller may share one cache across calls for as long as the
    devices it sees are the same objects (the controller keeps one while no slice changes).
    An expression that reads only named fields is evaluated once per distinct set of values
    of those fields, not once per device (``cel.device_fields``).
    """

    def __init__(self) -> None:
        self._activations: dict[int, Mapping[str, Any]] = {}
        self._devices: dict[int, Device] = {}
        self._results: dict[tuple[int, str], bool | SelectorError] = {}
        # By the values an expression reads (``cel.device_fields``): devices of a cluster differ
        # in uuid and bus id, but a selector reads type, profile, memory, and those repeat, so
        # a few evaluations serve thousands of devices.
        self._by_values: dict[tuple[str, tuple[object, ...]], bool | SelectorError] = {}
        self._tables: dict[int, DeviceTable | None] = {}  # None: a version fails to parse

    def _result(self, expression: str, driver: str, device: Device) -> bool | SelectorError:
        key = (id(device), expression)
        cached = self._results.get(key)
        if cached is not None:
            return cached
        fields = device_fields(expression)
        table = self._table(driver, device) if fields is not None else None
        if fields is not None and table is not None:
            by_values = (expression, field_values(fields, table))
            shared = self._by_values.get(by_values)
            if shared is None:
                shared = self._evaluate(expression, driver, device)
                self._by_values[by_values] = shared
            self._results[key] = shared
            self._devices[id(device)] = device
            return shared
        result = self._evaluate(expression, driver, device)
        self._results[key] = result
        return result

    def _table(self, driver: str, device: Device) -> DeviceTable | None:
        if id(device) not in self._tables:
            ok = versions_parse(device)
            self._tables[id(device)] = device_table(driver, device) if ok else None
            self._devices[id(device)] = device
        return self._tables[id(device)]

    def _evaluate(self, expression: str, driver: str, device: Device) -> bool | SelectorError:
        activation = self._activations.get(id(device))
        if activation is None:
            activation = device_activation(driver, device)
            self._activations[id(device)] = activation
            self._devices[id(device)] = device
        result: bool | SelectorError
        try:
            result = bool(evaluate(expression, activation))
        except SelectorError as err:
            result = err
        return result

    def matches(self, expressions: Sequence[str], driver: str, device: Device, where: str) -> bool:
        for index, expression in enumerate(expressions):
            result = self._result(expression, driver, device)
            if isinstance(result, SelectorError):
                raise SelectorError(
                    expression,
                    f"{where}: selector #{index} on device {driver}/{device.name}: "
                    f"{result.message}",
                    compile_error=result.compile_error,
                ) from result
            if not result:
                return False
        return True
