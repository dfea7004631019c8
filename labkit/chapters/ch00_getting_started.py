"""Chapter 00 (getting started): its parameter check and the straggler table.

The rank functions it launches are :func:`labkit.experiments.basics.hello` and
:func:`labkit.experiments.basics.straggler_all_reduce`.
"""

from __future__ import annotations

import pandas as pd

from labkit.chapters.common import check_world_size
from labkit.checks import positive_float, positive_int


def check_chapter(*, world_size: int, work_ms: float, steps: int, timeout_s: float) -> None:
    """Validate chapter 00's parameters before any launch. Raises ValueError naming the value and the fix:
    world_size >= 2 (section 4 makes rank 1 fail, and a collective needs a peer), work_ms > 0 (the
    straggler experiment needs unequal work), steps >= 1, timeout_s > 0."""
    check_world_size("00", world_size, why="a collective needs a peer, and section 4 makes rank 1 fail")
    positive_float("work_ms", work_ms)
    positive_int("steps", steps)
    positive_float("timeout_s", timeout_s)


def straggler_table(timeline) -> pd.DataFrame:
    """Predicted vs measured collective wait from a :func:`straggler_all_reduce` timeline.

    Per (step, rank), times in ms from the step's earliest compute start: ``compute_end_ms`` (measured),
    ``arrival_ms`` (measured: when the rank entered all_reduce), ``predicted_wait_ms`` = last arrival of the
    step - this rank's arrival (a collective cannot finish before the last rank has entered it; the
    communication itself taken as free), ``measured_ms`` (the all_reduce event's duration) and
    ``gap_ms`` = measured - predicted (the collective's own cost plus scheduling noise; >= 0 up to timer
    jitter for any correct collective).
    """
    df = timeline
    work = df[df["name"] == "work"].set_index(["step", "rank"])
    comm = df[df["name"] == "all_reduce"].set_index(["step", "rank"])
    out = pd.DataFrame(index=work.index)
    origin = work.groupby("step")["start_ns"].transform("min")
    out["compute_end_ms"] = (work["end_ns"] - origin) / 1e6
    out["arrival_ms"] = (comm["start_ns"] - origin) / 1e6
    last = comm.groupby("step")["start_ns"].transform("max")
    out["predicted_wait_ms"] = (last - comm["start_ns"]) / 1e6
    out["measured_ms"] = (comm["end_ns"] - comm["start_ns"]) / 1e6
    out["gap_ms"] = out["measured_ms"] - out["predicted_wait_ms"]
    return out.reset_index().sort_values(["step", "rank"]).reset_index(drop=True)
