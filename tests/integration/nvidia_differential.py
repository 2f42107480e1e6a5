"""What two drivers publish for the same GPUs, reduced to comparable facts, and the table of
known differences in docs/nvidia-differential.md.

Each published device becomes a record keyed by what it is on the machine — (parent GPU index,
profile, placement start), so NVIDIA's ``gpu-6-mig-1g10gb-19-0`` and flexgpu's device for the
same MIG placement meet — holding its name, attributes, capacities and counter consumption;
each shared counter set becomes a record of its GPU. Values are written with the device's own
identity replaced by placeholders (``<uuid>``, ``<i>``, ``<start>``, ...), so one difference
that every GPU shares is one row, and the devices it concerns are listed by kind
(``GPU``, ``MIG 1g.10gb``, ``counters``)."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes.utils import parse_quantity

DOC = Path(__file__).resolve().parents[2] / "docs" / "nvidia-differential.md"
START, END = "<!-- nvidia-differential:start -->", "<!-- nvidia-differential:end -->"
ABSENT = "(absent)"
NVIDIA_MIG_NAME = re.compile(r"^gpu-(\d+)-mig-(.+)-(\d+)-(\d+)$")
WHOLE_GPU_NAME = re.compile(r"^gpu-(\d+)$")

# (parent GPU index, "gpu" or the MIG profile, placement start or -1)
DeviceKey = tuple[int, str, int]
# (configuration, field, NVIDIA's value, flexgpu's value) -> device kinds it concerns
RowKey = tuple[str, str, str, str]


@dataclass(frozen=True)
class Identity:
    """What the placeholders stand for in one device's values."""

    index: int
    profile: str  # "" for a whole GPU
    start: int  # -1 for a whole GPU
    tokens: tuple[tuple[str, str], ...]  # (literal, placeholder), longest literal first

    def template(self, text: str) -> str:
        for literal, placeholder in self.tokens:
            if literal:
                text = text.replace(literal, placeholder)
        return text


def _attribute_value(value: Mapping[str, Any]) -> str:
    for kind in ("string", "version", "int", "bool"):
        if value.get(kind) is not None:
            return f"{kind} {value[kind]}"
    return "?"


def _quantity(value: Any) -> str:
    """Capacities and counters as exact integers, so ``80Gi`` and its byte count compare equal."""
    raw = value.get("value") if isinstance(value, Mapping) else value
    number = parse_quantity(str(raw))
    return str(int(number)) if number == int(number) else str(number)


def _attributes(device: Mapping[str, Any]) -> dict[str, str]:
    return {name: _attribute_value(v) for name, v in (device.get("attributes") or {}).items()}


def _short(name: str) -> str:
    """An attribute or capacity name without its domain: flexgpu qualifies none of its own, NVIDIA
    none of its own; the standard resource.kubernetes.io names keep theirs."""
    return name if name.startswith("resource.kubernetes.io/") else name.rsplit("/", 1)[-1]


@dataclass
class Published:
    """One driver's publication for one node: devices by key, counter sets by GPU index."""

    devices: dict[DeviceKey, dict[str, str]]
    identities: dict[DeviceKey, Identity]
    counter_sets: dict[int, dict[str, str]]


def _device_key(driver: str, device: Mapping[str, Any]) -> tuple[DeviceKey, str, str]:
    """Key, parent UUID and MIG UUID of a device, from its name (NVIDIA) or attributes."""
    attrs = {_short(k): v for k, v in (device.get("attributes") or {}).items()}

    def text(name: str) -> str:
        value = attrs.get(name) or {}
        for kind in ("string", "int"):
            if value.get(kind) is not None:
                return str(value[kind])
        return ""

    name = device["name"]
    kind = text("type")
    if driver == "nvidia":
        whole = WHOLE_GPU_NAME.match(name)
        if whole:
            return (int(whole.group(1)), "gpu", -1), text("uuid"), ""
        mig = NVIDIA_MIG_NAME.match(name)
        if mig:
            key = (int(mig.group(1)), text("profile"), int(mig.group(4)))
            return key, text("parentUUID"), text("uuid")
        raise ValueError(f"NVIDIA device name {name!r} is neither gpu-N nor a MIG name")
    if kind == "mig":
        start = text("placementStart")
        key = (int(text("parentIndex")), text("profile"), int(start or -1))
        return key, text("parentUUID"), text("uuid")
    return (int(text("index")), "gpu", -1), text("uuid"), ""


def reduce(driver: str, slices: Iterable[Mapping[str, Any]]) -> Published:
    """``slices`` as the API serves them (dicts in the API's camelCase)."""
    devices: dict[DeviceKey, dict[str, str]] = {}
    identities: dict[DeviceKey, Identity] = {}
    raw_sets: dict[str, dict[str, str]] = {}
    set_owner: dict[str, int] = {}
    bus_ids: dict[int, str] = {}
    for item in slices:
        spec = item["spec"]
        for counter_set in spec.get("sharedCounters") or []:
            raw_sets[counter_set["name"]] = {
                name: _quantity(v) for name, v in (counter_set.get("counters") or {}).items()
            }
        for device in spec.get("devices") or []:
            key, parent_uuid, mig_uuid = _device_key(driver, device)
            if key in devices:
                raise ValueError(f"{driver} publishes two devices for {key}")
            attrs = _attributes(device)
            bus = attrs.get("resource.kubernetes.io/pciBusID", "").removeprefix("string ")
            if bus:
                bus_ids[key[0]] = bus
            profile = "" if key[1] == "gpu" else key[1]
            tokens = [
                (mig_uuid, "<mig-uuid>"),
                (parent_uuid, "<uuid>"),
                (bus, "<pci>"),
                (f"gpu-{key[0]}", "gpu-<i>"),
                (profile, "<profile>"),
                (profile.replace(".", ""), "<profile>"),
                # Device names are DNS labels: "1g.10gb+me" is written 1g10gb-me.
                (profile.replace(".", "").replace("+", "-"), "<profile>"),
            ]
            tokens.sort(key=lambda pair: -len(pair[0]))
            identity = Identity(key[0], profile, key[2], tuple(tokens))
            record: dict[str, str] = {"name": device["name"]}
            for name, value in attrs.items():
                record[f"attribute {_short(name)}"] = value
            for name, value in (device.get("capacity") or {}).items():
                record[f"capacity {_short(name)}"] = _quantity(value)
            for consumption in device.get("consumesCounters") or []:
                set_owner[consumption["counterSet"]] = key[0]
                for name, value in (consumption.get("counters") or {}).items():
                    record[f"consumes {name}"] = _quantity(value)
                record["counter set"] = consumption["counterSet"]
            for flag in ("allowMultipleAllocations", "bindsToNode"):
                if device.get(flag) is not None:
                    record[flag] = str(device[flag]).lower()
            for conditions in ("bindingConditions", "bindingFailureConditions"):
                if device.get(conditions):
                    record[conditions] = ",".join(device[conditions])
            for taint in device.get("taints") or []:
                effect, why = taint.get("effect", ""), taint.get("value")
                record[f"taint {_short(taint['key'])}"] = f"{effect} ({why})" if why else effect
            devices[key] = record
            identities[key] = identity
    counter_sets: dict[int, dict[str, str]] = {}
    for name, counters in raw_sets.items():
        index = set_owner.get(name, -1)
        counter_sets[index] = {"name": name, **{f"counter {k}": v for k, v in counters.items()}}
    return Published(devices, identities, counter_sets)


def _kind(key: DeviceKey) -> str:
    return "GPU" if key[1] == "gpu" else f"MIG {key[1]}"


def differences(
    configuration: str,
    nvidia: Published,
    flexgpu: Published,
    gpus: Collection[int] | None = None,
) -> dict[RowKey, str]:
    """Every fact on which the two publications differ, as table rows: (configuration, field,
    NVIDIA's value, flexgpu's value) -> the device kinds concerned; ``gpus`` limits the
    comparison to those GPUs' devices and counters."""
    rows: dict[RowKey, set[str]] = defaultdict(set)
    for key in sorted(nvidia.devices.keys() | flexgpu.devices.keys()):
        if gpus is not None and key[0] not in gpus:
            continue
        theirs, ours = nvidia.devices.get(key), flexgpu.devices.get(key)
        identity = (nvidia.identities.get(key) or flexgpu.identities[key]).template
        if theirs is None or ours is None:
            rows[(configuration, "device", _presence(theirs), _presence(ours))].add(_kind(key))
            continue
        for field in sorted(theirs.keys() | ours.keys()):
            a = identity(theirs.get(field, ABSENT))
            b = identity(ours.get(field, ABSENT))
            if field in {"name", "counter set"}:
                # Names differ by design; only their shapes are compared.
                a = _name_shape(identity, theirs.get(field))
                b = _name_shape(identity, ours.get(field))
            a, b = _present(a, b), _present(b, a)
            if a != b:
                rows[(configuration, field, a, b)].add(_kind(key))
    for index in sorted(nvidia.counter_sets.keys() | flexgpu.counter_sets.keys()):
        if gpus is not None and index not in gpus:
            continue
        theirs_set = nvidia.counter_sets.get(index, {})
        ours_set = flexgpu.counter_sets.get(index, {})
        for field in sorted(theirs_set.keys() | ours_set.keys()):
            a = theirs_set.get(field, ABSENT).replace(f"gpu-{index}", "gpu-<i>")
            b = ours_set.get(field, ABSENT).replace(f"gpu-{index}", "gpu-<i>")
            a, b = _present(a, b), _present(b, a)
            if a != b:
                rows[(configuration, f"shared {field}", a, b)].add("counters")
    return {row: ", ".join(sorted(kinds, key=_kind_order)) for row, kinds in rows.items()}


def _presence(record: Mapping[str, str] | None) -> str:
    """Whether a device is published, with its taints: a withdrawn device and a tainted one are
    the two ways a driver reports an unhealthy GPU."""
    if record is None:
        return ABSENT
    taints = [
        f"{field} {value}" for field, value in sorted(record.items()) if field.startswith("taint ")
    ]
    return "; ".join(["published", *taints])


def _present(value: str, other: str) -> str:
    """A fact only one driver publishes is a row per field, not per value: the value becomes
    its type (``int``, ``string``, ``bool``, ``version``) or ``quantity``."""
    if other != ABSENT or value == ABSENT:
        return value
    kind, _, rest = value.partition(" ")
    if rest and kind in {"int", "string", "bool", "version"}:
        return kind
    return "quantity" if re.fullmatch(r"-?\d+(\.\d+)?", value) else value


def _name_shape(template: Any, name: str | None) -> str:
    if name is None:
        return ABSENT
    shaped: str = template(name)
    if "mig" not in shaped:
        return shaped
    # NVIDIA's MIG names end in <profile id>-<start>, flexgpu's in <start>.
    if re.search(r"-\d+-\d+$", shaped):
        return re.sub(r"-\d+-\d+$", "-<id>-<start>", shaped)
    return re.sub(r"-\d+$", "-<start>", shaped)


def _kind_order(kind: str) -> tuple[int, str]:
    order = {"GPU": 0, "counters": 2}
    return (order.get(kind, 1), kind)


@dataclass(frozen=True)
class DocumentedRow:
    devices: str
    reason: str


def documented() -> dict[RowKey, DocumentedRow]:
    """The table between the markers in docs/nvidia-differential.md."""
    text = DOC.read_text(encoding="utf-8")
    table = text[text.index(START) + len(START) : text.index(END)]
    rows: dict[RowKey, DocumentedRow] = {}
    for line in table.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 6 or cells[0] == "Configuration" or set(cells[0]) <= {"-", ":", " "}:
            continue
        configuration, field, theirs, ours, devices, reason = (
            c.strip("`").replace("\\|", "|") for c in cells
        )
        key = (configuration, field, theirs, ours)
        if key in rows:
            raise AssertionError(f"docs/nvidia-differential.md lists {key} twice")
        rows[key] = DocumentedRow(devices, reason)
    return rows


def render(rows: Mapping[RowKey, str]) -> str:
    """Table lines for measured rows (reasons left for a person to write): what to paste
    between the markers when the measurement changes."""
    lines = []
    for (configuration, field, theirs, ours), devices in sorted(rows.items()):
        lines.append(f"| {configuration} | {field} | `{theirs}` | `{ours}` | {devices} | |")
    return "\n".join(lines)
