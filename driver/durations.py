"""Durations as Prometheus writes them (``90s``, ``30m``, ``2h``, ``1h30m``): the chart sets
the idle window once, for the alert rule and for both daemons. And durations for people
(``human_duration``): ``45s``, ``12m``, ``3h20m``, ``2d4h``, in the style of kubectl's AGE
column, two units at most, the smaller truncated (59 minutes read ``59m``, never ``1h``); for
tables and Event messages, while machine output keeps plain seconds."""

from __future__ import annotations

import math
import re
from typing import Final

_PART: Final = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_UNIT_S: Final = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def parse_duration(text: str) -> float:
    """Seconds of ``text``; ValueError naming the text and the allowed form otherwise."""
    parts = _PART.findall(text)
    if not text or "".join(n + u for n, u in parts) != text:
        raise ValueError(
            f"{text!r} is not a duration; allowed: a number with a unit (ms, s, m, h, d, w, y), "
            "such as 90s, 30m, 2h or 1h30m"
        )
    return float(sum(int(n) * _UNIT_S[u] for n, u in parts))


_MINUTE = 60
_HOUR = 60 * _MINUTE
_DAY = 24 * _HOUR


def human_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        raise ValueError(f"duration {seconds!r} is not a finite number of seconds")
    s = max(0, int(seconds))  # a small negative figure (clocks apart) reads as 0s
    if s < _MINUTE:
        return f"{s}s"
    if s < _HOUR:
        return f"{s // _MINUTE}m"
    if s < _DAY:
        hours, minutes = divmod(s // _MINUTE, 60)
        return f"{hours}h{minutes}m" if minutes else f"{hours}h"
    days, hours = divmod(s // _HOUR, 24)
    return f"{days}d{hours}h" if hours else f"{days}d"
