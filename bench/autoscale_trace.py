"""A day-shaped trace of GPU claims for ``bench.autoscale_replay``: inference (MIG partitions
and GPU shares) that follows working hours, and training bursts (single GPUs and 4-GPU sets on
one NVLink domain) in the morning and after lunch. Seeded: one seed, one trace."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Final

from flexgpu.driver.names import DRIVER_NAME

MINUTES_PER_DAY: Final = 24 * 60


@dataclass(frozen=True)
class ClaimKind:
    """``gpus``: GPU-equivalents the claim uses while it runs (a 1g.10gb partition is 1/8 of
    an H100's memory slices, a 20 GiB share a quarter of its 80 GB)."""

    name: str
    gpus: float
    min_minutes: int
    max_minutes: int
    requests: tuple[dict[str, Any], ...]
    constraints: tuple[dict[str, Any], ...] = ()

    def claim_body(self) -> dict[str, Any]:
        return {
            "metadata": {"name": self.name, "namespace": "replay"},
            "spec": {
                "devices": {
                    "requests": list(self.requests),
                    "constraints": list(self.constraints),
                }
            },
        }


def _exactly(name: str, device_class: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": device_class, **extra}}


def _profile(name: str) -> list[dict[str, Any]]:
    return [{"cel": {"expression": f'device.attributes["{DRIVER_NAME}"].profile == "{name}"'}}]


KINDS: Final = (
    ClaimKind(
        "train-4gpu-nvlink",
        4.0,
        120,
        360,
        (_exactly("gpus", "gpu.flexgpu.dev", count=4),),
        ({"requests": ["gpus"], "matchAttribute": f"{DRIVER_NAME}/nvlinkDomain"},),
    ),
    ClaimKind("train-1gpu", 1.0, 60, 240, (_exactly("gpu", "gpu.flexgpu.dev"),)),
    ClaimKind(
        "infer-mig-1g",
        1 / 8,
        20,
        120,
        (_exactly("mig", "mig.flexgpu.dev", selectors=_profile("1g.10gb")),),
    ),
    ClaimKind(
        "infer-mig-3g",
        4 / 8,
        30,
        180,
        (_exactly("mig", "mig.flexgpu.dev", selectors=_profile("3g.40gb")),),
    ),
    ClaimKind(
        "infer-share-20gi",
        1 / 4,
        15,
        90,
        (_exactly("share", "shared-gpu.flexgpu.dev", capacity={"requests": {"memory": "20Gi"}}),),
    ),
)
BY_NAME: Final = {kind.name: kind for kind in KINDS}


@dataclass(frozen=True)
class Arrival:
    minute: int
    kind: str
    minutes: int  # how long it runs once placed


def working_hours(minute: int) -> float:
    """0 at night, 1 at 14:00: a half sine from 07:00 to 21:00."""
    hour = (minute % MINUTES_PER_DAY) / 60
    if not 7 <= hour <= 21:
        return 0.0
    return math.sin(math.pi * (hour - 7) / 14)


# Claims per hour at the day's peak (inference) or per burst (training).
INFERENCE_PER_HOUR: Final = {"infer-mig-1g": 14.0, "infer-mig-3g": 4.0, "infer-share-20gi": 10.0}
NIGHT_SHARE: Final = 0.15  # inference at night, as a share of the peak rate
BURSTS: Final = (
    (9 * 60, {"train-4gpu-nvlink": 4, "train-1gpu": 6}),
    (14 * 60, {"train-4gpu-nvlink": 3, "train-1gpu": 4}),
)
BURST_SPREAD_MINUTES: Final = 30


def day_trace(seed: int, days: int = 1) -> list[Arrival]:
    rng = random.Random(seed)
    arrivals: list[Arrival] = []

    def add(minute: int, name: str) -> None:
        kind = BY_NAME[name]
        arrivals.append(Arrival(minute, name, rng.randint(kind.min_minutes, kind.max_minutes)))

    for minute in range(days * MINUTES_PER_DAY):
        level = NIGHT_SHARE + (1 - NIGHT_SHARE) * working_hours(minute)
        for name, per_hour in INFERENCE_PER_HOUR.items():
            if rng.random() < per_hour * level / 60:
                add(minute, name)
    for day in range(days):
        for start, counts in BURSTS:
            for name, count in counts.items():
                for _ in range(count):
                    add(day * MINUTES_PER_DAY + start + rng.randrange(BURST_SPREAD_MINUTES), name)
    return sorted(arrivals, key=lambda a: a.minute)
