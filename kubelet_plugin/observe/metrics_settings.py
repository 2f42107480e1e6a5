"""The plugin's metrics settings, read from the environment (variables: metrics_setup.py).

Kept apart from metrics_setup so that a plugin without a metrics port validates them without
importing prometheus_client and the usage sampler (about 6 MiB of resident memory).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from flexgpu.driver.durations import parse_duration

if TYPE_CHECKING:
    from flexgpu.kubelet_plugin.observe.usage_model import UsageSettings


class MetricsSettingError(ValueError):
    """A metrics variable has a value the plugin cannot use; the text names it."""


@dataclass(frozen=True)
class MetricsSettings:
    port: int | None = None  # None: no endpoint, no sampling
    address: str = "0.0.0.0"
    interval_s: float = 15.0
    idle_threshold: float = 0.05
    idle_window_s: float = 7200.0
    proc_root: Path = Path("/proc")

    @property
    def usage(self) -> UsageSettings:
        from flexgpu.kubelet_plugin.observe.usage_model import UsageSettings

        return UsageSettings(
            interval_s=self.interval_s,
            idle_threshold=self.idle_threshold,
            idle_window_s=self.idle_window_s,
            proc_root=self.proc_root,
        )


def _number(env: Mapping[str, str], name: str, default: float, low: float, high: float) -> float:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not low <= value <= high:
        raise MetricsSettingError(
            f"{name}: {text!r} is not allowed; allowed: a number from {low:g} to {high:g}"
        )
    return value


def settings_from_env(env: Mapping[str, str]) -> MetricsSettings:
    port_text = env.get("FLEXGPU_METRICS_PORT", "").strip()
    if port_text and not (port_text.isdigit() and int(port_text) <= 65535):
        raise MetricsSettingError(
            f"FLEXGPU_METRICS_PORT: {port_text!r} is not allowed; allowed: a port number "
            "0-65535 (0 or empty: no metrics endpoint)"
        )
    window_text = env.get("FLEXGPU_IDLE_WINDOW", "").strip() or "2h"
    try:
        window = parse_duration(window_text)
    except ValueError:
        raise MetricsSettingError(
            f"FLEXGPU_IDLE_WINDOW: {window_text!r} is not allowed; allowed: a duration such "
            "as 90s, 30m, 2h or 1h30m"
        ) from None
    return MetricsSettings(
        port=int(port_text) if port_text and int(port_text) > 0 else None,
        address=env.get("FLEXGPU_METRICS_ADDRESS", "").strip() or "0.0.0.0",
        interval_s=_number(env, "FLEXGPU_USAGE_INTERVAL", 15.0, 0.1, 3600.0),
        idle_threshold=_number(env, "FLEXGPU_IDLE_THRESHOLD", 0.05, 0.0, 1.0),
        idle_window_s=window,
        proc_root=Path(env.get("FLEXGPU_PROC_ROOT", "").strip() or "/proc"),
    )
