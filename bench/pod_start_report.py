"""What bench/pod_start.py prints: the side-by-side table against the reference driver with
its target, every variant's percentiles, and where each variant's pod starts went."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from bench.compare_table import Row, percentile, ratio_at_most, render
from bench.pod_phases import PodTimes, ProgramTimes, phase_medians, program_medians, render_phases

AT_ONCE = 8
TARGET = 1.1


class Measured(Protocol):
    """What one variant's measurement holds (bench.pod_start.Starts)."""

    sequential_s: list[float]
    concurrent_s: list[float]
    times: dict[str, PodTimes]
    sequential: list[str]
    concurrent: list[str]
    programs: ProgramTimes | None
    programs_concurrent: ProgramTimes | None
    untraced: int


def rows(flexgpu: Measured, example: Measured) -> list[Row]:
    def row(pick: Callable[[Measured], list[float]], pct: float, name: str) -> Row:
        return Row(
            name,
            percentile(pick(flexgpu), pct),
            percentile(pick(example), pct),
            2,
            ratio_at_most(TARGET),
        )

    return [
        row(lambda s: s.sequential_s, 50, "pod start p50 s, one at a time"),
        row(lambda s: s.sequential_s, 99, "pod start p99 s, one at a time"),
        row(lambda s: s.concurrent_s, 50, f"pod start p50 s, {AT_ONCE} at once"),
        row(lambda s: s.concurrent_s, 99, f"pod start p99 s, {AT_ONCE} at once"),
    ]


def percentiles(variants: Mapping[str, Measured]) -> str:
    """Every variant's pod start p50/p99, one at a time and 8 at once."""
    columns: dict[str, dict[str, float]] = {}
    for name, starts in variants.items():
        columns[name] = {
            "pod start p50 s, one at a time": percentile(starts.sequential_s, 50),
            "pod start p99 s, one at a time": percentile(starts.sequential_s, 99),
            f"pod start p50 s, {AT_ONCE} at once": percentile(starts.concurrent_s, 50),
            f"pod start p99 s, {AT_ONCE} at once": percentile(starts.concurrent_s, 99),
        }
    return render_phases(columns, digits=2, heading="figure")


def phases(variants: Mapping[str, Measured], concurrent: bool) -> str:
    """Each phase's median per variant, then the traced programs' median run times and
    runs per container started."""
    columns: dict[str, dict[str, float]] = {}
    for name, starts in variants.items():
        names = starts.concurrent if concurrent else starts.sequential
        column = phase_medians(starts.times[n] for n in names if n in starts.times)
        programs = starts.programs_concurrent if concurrent else starts.programs
        if programs is not None:
            # One at a time, the warm-up pod's runs are in too.
            containers = len(names) + (0 if concurrent else 1)
            column.update(program_medians(programs, containers))
        columns[name] = column
    return render_phases(columns)


def report(variants: Mapping[str, Measured], paired: str | None) -> str:
    """With ``paired`` (the prefix of the reference driver's labels: ``ex-<variant>`` ran
    taking turns with ``<variant>``), each variant's side-by-side table against the pods that
    took turns with it, flexgpu as shipped first (the target); then every column's
    percentiles and where the time went."""
    parts: list[str] = []
    if paired is not None:
        for name in [n for n in variants if not n.startswith(paired)]:
            beside = variants.get(f"{paired}{name}")
            if beside is not None:
                title = "flexgpu as shipped" if name == "flexgpu" else f"variant {name}"
                parts.append(
                    f"{title} (flexgpu column) against the reference driver's pods that took "
                    f"turns with it:\n\n" + render(rows(variants[name], beside))
                )
    parts.append("Every column:\n\n" + percentiles(variants))
    parts.append(
        "Where the time went, one at a time (phases: p50 s; programs: p50 ms, and runs per "
        "container):\n\n" + phases(variants, concurrent=False)
    )
    parts.append(f"Where the time went, {AT_ONCE} at once:\n\n" + phases(variants, True))
    untraced = {n: s.untraced for n, s in variants.items() if s.untraced}
    if untraced:
        parts.append(f"Process events lost or unnamed while tracing: {untraced}")
    return "\n\n".join(parts)


def variant_names(chosen: Sequence[str], known: Sequence[str]) -> list[str]:
    """``chosen`` in the order of ``known`` (the order the variants must run in)."""
    unknown = sorted(set(chosen) - set(known))
    if unknown:
        raise ValueError(f"--variants: {unknown} unknown; allowed: {', '.join(known)}")
    return [k for k in known if k in chosen]
