"""Durations as Prometheus writes them (``90s``, ``30m``, ``2h``, ``1h30m``): the chart sets
the idle window once, for the alert rule and for both daemons."""

from __future__ import annotations

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
