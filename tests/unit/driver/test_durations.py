"""flexgpu.driver.durations: seconds read as kubectl's AGE column does, two units at most,
the smaller truncated; nothing that is not a finite number is printed as a duration."""

from __future__ import annotations

import pytest

from flexgpu.driver.durations import human_duration


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (0, "0s"),
        (0.9, "0s"),
        (45, "45s"),
        (59.99, "59s"),
        (60, "1m"),
        (12 * 60 + 59, "12m"),
        (3599, "59m"),
        (3600, "1h"),
        (3 * 3600 + 20 * 60 + 59, "3h20m"),
        (2 * 3600 + 5 * 60, "2h5m"),
        (86399, "23h59m"),
        (86400, "1d"),
        (2 * 86400 + 4 * 3600 + 59 * 60, "2d4h"),
        (400 * 86400, "400d"),
        (-2, "0s"),
    ],
)
def test_durations_read_like_kubectl_ages(seconds: float, shown: str) -> None:
    assert human_duration(seconds) == shown


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_durations_are_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="not a finite number"):
        human_duration(bad)
