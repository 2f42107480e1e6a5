"""Which opaque config applies to each allocated device of a claim. Pure: no API calls.

Input is a ``config`` list in the API's JSON shape (``resource.k8s.io/v1``), usually the
allocation result's ``claim.status.allocation.devices.config``::

    {"source": "FromClass" | "FromClaim", "requests": ["gpu", "main/large"],
     "opaque": {"driver": "gpu.flexgpu.dev", "parameters": {...}}}

Objects of the ``kubernetes`` client become this shape with
``ApiClient().sanitize_for_serialization(obj)``.

Rules, following upstream ``resourceclaim.ConfigForResult`` (k8s.io/dynamic-resource-allocation)
and NVIDIA's DRA driver (``GetOpaqueDeviceConfigs`` and ``prepareDevices``):

1. Entries for other drivers are ignored: a class may be served by several drivers. Entries
   without ``opaque`` (a config type newer than this driver) are ignored too.
2. Precedence: ``FromClass`` ranks below ``FromClaim``; within a source, later entries win. The
   allocator lists class configs first already; this does not rely on it.
3. Scope: an entry with no ``requests`` applies to every request. Otherwise it applies to each
   request reference it names, and a main request's name also covers its ``firstAvailable``
   subrequests: ``main`` covers ``main/large``, while ``main/large`` covers only itself (the
   allocation result names a subrequest as ``<main>/<sub>``). Names carry no specificity: a
   later entry naming ``main`` beats an earlier one naming ``main/large``.
4. Kind against device: from the highest-precedence applicable entry down, the first whose kind
   fits the device wins (``GpuConfig`` for whole and shared GPUs, ``MigConfig`` for MIG
   devices). An entry of the wrong kind that *names* the request is an error; one that applies
   to every request is skipped, so a claim can hold a blanket ``GpuConfig`` and a blanket
   ``MigConfig`` side by side.
5. If no entry applies, the device gets the default of its kind (sharing ``Exclusive``).

Every entry for this driver is parsed, whether it applies to a prepared device or not: a config
that does not parse is a user error to report, as NVIDIA's driver does. So is a valid config
this driver cannot carry out yet (``driver.config_support``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final, Literal, TypeAlias, get_args

from flexgpu.driver.config_support import unsupported_on_device, unsupported_settings
from flexgpu.driver.mps_limits import index_keys_beyond
from flexgpu.driver.names import DRIVER_NAME
from flexgpu.driver.opaque_config import (
    ROOT_ALLOWED,
    GpuConfig,
    MigConfig,
    OpaqueConfig,
    OpaqueConfigError,
    parse_opaque_config,
    show_value,
)
from flexgpu.driver.quantity import QuantityError, parse_quantity
from flexgpu.driver.user_text import shorten

DeviceType: TypeAlias = Literal["gpu", "mig", "shared"]
DEVICE_TYPES: Final[tuple[DeviceType, ...]] = get_args(DeviceType)

_DEVICE_WORDS: Final[dict[str, str]] = {
    "gpu": "a whole GPU",
    "mig": "a MIG device",
    "shared": "a shared GPU",
}


class ConfigSource(StrEnum):
    CLASS = "FromClass"
    CLAIM = "FromClaim"


class ConfigResolutionError(ValueError):
    """The configs of a claim cannot be applied; ``problems`` holds one text per problem."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


@dataclass(frozen=True)
class ConfigEntry:
    """One parsed config for this driver; ``index`` is its position in the list given."""

    index: int
    source: ConfigSource
    requests: tuple[str, ...]
    config: OpaqueConfig

    def applies_to(self, request: str) -> bool:
        """Upstream ``isMatch``: no names means every request; a main name covers subrequests."""
        if not self.requests:
            return True
        return request in self.requests or _main_request(request) in self.requests

    def describe(self) -> str:
        origin = "class" if self.source is ConfigSource.CLASS else "claim"
        return f"config[{self.index}] from the {origin}"


@dataclass(frozen=True)
class ResolvedConfig:
    """The entries that apply to one request, highest precedence first."""

    request: str
    candidates: tuple[ConfigEntry, ...]

    @property
    def winner(self) -> OpaqueConfig | None:
        """The highest-precedence config regardless of device; ``None`` if none applies."""
        return self.candidates[0].config if self.candidates else None

    def for_device(self, device_type: DeviceType, device_name: str) -> OpaqueConfig:
        """The config for one allocated device of this request (rules 4 and 5).

        Raises ``ConfigResolutionError`` when an entry naming this request has the wrong kind.
        """
        for entry in self.candidates:
            if config_applies_to_device(entry.config, device_type):
                return entry.config
            if entry.requests:
                message = wrong_kind_message(
                    entry.config, self.request, device_type, device_name, entry.describe()
                )
                raise ConfigResolutionError([message])
        return default_config(device_type)


def default_config(device_type: DeviceType) -> OpaqueConfig:
    """What a device gets when no config applies: exclusive use."""
    return MigConfig() if _checked(device_type) == "mig" else GpuConfig()


def config_applies_to_device(config: OpaqueConfig, device_type: DeviceType) -> bool:
    """``GpuConfig`` configures whole and shared GPUs, ``MigConfig`` MIG devices."""
    if _checked(device_type) == "mig":
        return isinstance(config, MigConfig)
    return isinstance(config, GpuConfig)


def wrong_kind_message(
    config: OpaqueConfig,
    request: str,
    device_type: DeviceType,
    device_name: str | None = None,
    origin: str | None = None,
) -> str:
    """``request "gpu": MigConfig cannot configure a whole GPU (gpu-0); use GpuConfig``, with
    `` (config[1] from the claim)`` appended when ``origin`` is given."""
    wanted = default_config(device_type).kind
    device = _DEVICE_WORDS[device_type] + (f" ({shorten(device_name)})" if device_name else "")
    text = f'request "{shorten(request)}": {config.kind} cannot configure {device}; use {wanted}'
    return text + (f" ({origin})" if origin else "")


def resolve_configs(
    configs: object, request_names: Sequence[str], *, driver: str = DRIVER_NAME
) -> dict[str, ResolvedConfig]:
    """Map each request reference (as in the allocation result: ``gpu`` or ``main/large``) to
    the entries that apply to it. ``configs`` is the allocation result's ``config`` list.

    Raises ``ConfigResolutionError`` with every problem of every entry for ``driver``.
    """
    entries = parse_config_entries(configs, driver=driver)
    # Highest precedence first: claim above class, later above earlier.
    ranked = sorted(entries, key=lambda e: (e.source is ConfigSource.CLAIM, e.index), reverse=True)
    return {
        request: ResolvedConfig(request, tuple(e for e in ranked if e.applies_to(request)))
        for request in request_names
    }


def parse_config_entries(
    configs: object,
    *,
    path: str = "config",
    source: ConfigSource | None = None,
    driver: str = DRIVER_NAME,
) -> list[ConfigEntry]:
    """Parse the entries for ``driver`` of a ``config`` list.

    With ``source=None`` every entry must carry ``source`` (an allocation result). For a
    claim's ``spec.devices.config`` pass ``ConfigSource.CLAIM``, for a DeviceClass's
    ``spec.config`` ``ConfigSource.CLASS``. Problem texts start with ``path``.
    """
    entries, problems = _parse_entries(configs, path, source, driver)
    if problems:
        raise ConfigResolutionError(problems)
    return entries


def validate_config_entries(
    configs: object,
    *,
    path: str,
    source: ConfigSource | None = ConfigSource.CLAIM,
    request_device_types: Mapping[str, DeviceType] | None = None,
    request_counts: Mapping[str, int | None] | None = None,
    request_compute: Mapping[str, int] | None = None,
    driver: str = DRIVER_NAME,
) -> list[str]:
    """The admission webhook's check of a ``config`` list; returns the problems, ``[]`` if none.

    ``path`` names the list in the object (``spec.devices.config`` for a claim,
    ``spec.spec.devices.config`` for a template, ``spec.config`` for a DeviceClass). When
    ``request_device_types`` maps request references to the type their class selects, an
    entry that names a request and has the wrong kind for it is reported too, as prepare
    would refuse it, and so is the config prepare would pick for such a request (rules 2-4)
    when it cannot be applied to that type of device (``unsupported_on_device``). When
    ``request_counts`` (``request_device_counts``) gives how many devices each request asks
    for, an MPS config's per-device index keys beyond the devices it will configure are
    reported too (``driver.mps_limits``). ``request_compute`` (``request_compute_percents``)
    gives the compute each request reserves, which a fraction's ``share.computeLimit`` may
    not be below.
    """
    entries, problems = _parse_entries(configs, path, source, driver)
    types = request_device_types or {}
    for entry in entries:
        for named in entry.requests:
            for ref, device_type in types.items():
                covered = ref == named or _main_request(ref) == named
                if covered and not config_applies_to_device(entry.config, device_type):
                    message = wrong_kind_message(entry.config, ref, device_type)
                    problems.append(f"{path}[{entry.index}]: {message}")
    ranked = sorted(entries, key=lambda e: (e.source is ConfigSource.CLAIM, e.index), reverse=True)
    chosen_for: dict[str, ConfigEntry] = {}
    for ref, device_type in types.items():
        chosen = next(
            (
                e
                for e in ranked
                if e.applies_to(ref) and config_applies_to_device(e.config, device_type)
            ),
            None,
        )
        if chosen is None:
            continue
        chosen_for[ref] = chosen
        reserved = (request_compute or {}).get(ref)
        unsupported = unsupported_on_device(chosen.config, device_type, ref, reserved)
        if unsupported:
            prefix = f"{path}[{chosen.index}].opaque.parameters"
            problems += OpaqueConfigError(unsupported).render(prefix)
    if request_counts is not None:
        for entry in entries:
            count = _devices_configured(entry, chosen_for, request_counts)
            mps = entry.config.effective_sharing.mpsConfig
            if count is not None and mps is not None:
                beyond = index_keys_beyond(mps, count)
                prefix = f"{path}[{entry.index}].opaque.parameters"
                problems += OpaqueConfigError(beyond).render(prefix) if beyond else []
    return problems


def _devices_configured(
    entry: ConfigEntry, chosen_for: Mapping[str, ConfigEntry], counts: Mapping[str, int | None]
) -> int | None:
    """The most devices ``entry`` can configure: per main request, the largest count among the
    references it is chosen for (one ``firstAvailable`` subrequest is allocated, not all).
    ``None`` when a count is unknown (allocation mode All)."""
    per_main: dict[str, int] = {}
    for ref, chosen in chosen_for.items():
        if chosen is not entry:
            continue
        count = counts.get(ref)
        if count is None:
            return None
        main = _main_request(ref)
        per_main[main] = max(per_main.get(main, 0), count)
    return sum(per_main.values()) if per_main else None


def request_device_counts(requests: object) -> dict[str, int | None]:
    """How many devices each request reference of ``spec.devices.requests`` (v1) asks for:
    ``count`` in allocation mode ExactCount (default 1), ``None`` in mode All. Malformed
    parts are skipped (the apiserver's validation reports them)."""
    out: dict[str, int | None] = {}
    for raw in requests if isinstance(requests, list | tuple) else ():
        if not isinstance(raw, Mapping) or not isinstance(raw.get("name"), str):
            continue
        name = raw["name"]
        if isinstance(raw.get("exactly"), Mapping):
            out[name] = _count(raw["exactly"])
        subrequests = raw.get("firstAvailable")
        for sub in subrequests if isinstance(subrequests, list | tuple) else ():
            if isinstance(sub, Mapping) and isinstance(sub.get("name"), str):
                out[f"{name}/{sub['name']}"] = _count(sub)
    return out


def request_compute_percents(requests: object) -> dict[str, int]:
    """The percent of SMs each request reference of ``spec.devices.requests`` (v1) reserves:
    its ``capacity.requests.compute`` rounded up to a whole percent, as the shared GPU's
    request policy (step 1) rounds it. References without one, or with a malformed one (the
    apiserver's validation reports it), are left out."""
    out: dict[str, int] = {}
    for raw in requests if isinstance(requests, list | tuple) else ():
        if not isinstance(raw, Mapping) or not isinstance(raw.get("name"), str):
            continue
        parts = [(raw["name"], raw.get("exactly"))]
        subrequests = raw.get("firstAvailable")
        for sub in subrequests if isinstance(subrequests, list | tuple) else ():
            if isinstance(sub, Mapping) and isinstance(sub.get("name"), str):
                parts.append((f"{raw['name']}/{sub['name']}", sub))
        for ref, request in parts:
            percent = _compute(request)
            if percent is not None:
                out[ref] = percent
    return out


def _compute(request: object) -> int | None:
    capacity = request.get("capacity") if isinstance(request, Mapping) else None
    wanted = capacity.get("requests") if isinstance(capacity, Mapping) else None
    text = wanted.get("compute") if isinstance(wanted, Mapping) else None
    if not isinstance(text, str | int) or isinstance(text, bool):
        return None
    try:
        return parse_quantity(str(text)).ceil()
    except QuantityError:
        return None


def _count(request: Mapping[object, object]) -> int | None:
    if request.get("allocationMode") == "All":
        return None
    count = request.get("count", 1)
    return count if type(count) is int else None


def _parse_entries(
    configs: object, path: str, source: ConfigSource | None, driver: str
) -> tuple[list[ConfigEntry], list[str]]:
    if configs is None:
        return [], []
    if not isinstance(configs, list | tuple):
        allowed = "a list of device configurations"
        return [], [f"{path}: {show_value(configs)} is not allowed; allowed: {allowed}"]
    entries: list[ConfigEntry] = []
    problems: list[str] = []
    for index, raw in enumerate(configs):
        where = f"{path}[{index}]"
        if not isinstance(raw, Mapping):
            allowed = "an object with source, requests and opaque"
            problems.append(f"{where}: {show_value(raw)} is not allowed; allowed: {allowed}")
            continue
        opaque = raw.get("opaque")
        if opaque is None:
            continue  # rule 1: a configuration type this driver does not know
        if not isinstance(opaque, Mapping) or not isinstance(opaque.get("driver"), str):
            allowed = "an object with driver and parameters"
            problems.append(
                f"{where}.opaque: {show_value(opaque)} is not allowed; allowed: {allowed}"
            )
            continue
        if opaque["driver"] != driver:
            continue  # rule 1: another driver's
        entry_source, entry_problems = _source(raw, where, source)
        requests, request_problems = _requests(raw, where)
        problems += entry_problems + request_problems
        if "parameters" not in opaque:
            problems.append(f"{where}.opaque.parameters: missing; allowed: {ROOT_ALLOWED}")
            continue
        try:
            config = parse_opaque_config(opaque["parameters"])
        except OpaqueConfigError as error:
            problems += error.render(f"{where}.opaque.parameters")
            continue
        # Valid but beyond what prepare can apply: refused here, where admission and prepare
        # both pass, so the two cannot disagree.
        unsupported = unsupported_settings(config)
        if unsupported:
            problems += OpaqueConfigError(unsupported).render(f"{where}.opaque.parameters")
            continue
        if entry_source is not None and requests is not None:
            entries.append(ConfigEntry(index, entry_source, requests, config))
    return entries, problems


def _source(
    raw: Mapping[object, object], where: str, fixed: ConfigSource | None
) -> tuple[ConfigSource | None, list[str]]:
    if fixed is not None:
        return fixed, []
    value = raw.get("source")
    for member in ConfigSource:
        if value == member.value:
            return member, []
    allowed = ", ".join(ConfigSource)
    shown = "missing" if value is None else f"{show_value(value)} is not allowed"
    return None, [f"{where}.source: {shown}; allowed: {allowed}"]


def _requests(raw: Mapping[object, object], where: str) -> tuple[tuple[str, ...] | None, list[str]]:
    value = raw.get("requests")
    if value is None:
        return (), []
    if isinstance(value, list | tuple) and all(isinstance(name, str) for name in value):
        return tuple(value), []
    allowed = 'a list of request names ("gpu", or "main/sub" for a subrequest)'
    return None, [f"{where}.requests: {show_value(value)} is not allowed; allowed: {allowed}"]


def _main_request(ref: str) -> str:
    """``main/large`` -> ``main`` (upstream ``resourceclaim.BaseRequestRef``)."""
    return ref.split("/", maxsplit=1)[0]


def _checked(device_type: str) -> str:
    if device_type not in _DEVICE_WORDS:
        raise ValueError(f"unknown device type {device_type!r}; known: {', '.join(DEVICE_TYPES)}")
    return device_type
