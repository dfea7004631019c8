"""Chapter 11 (strong vs weak scaling): its parameter check and the text table of a series, every speedup and
efficiency printed with its baseline and the ratio that makes it.

What it launches is :func:`labkit.experiments.scaling.run` (the series runner and its two experiments, the
data-parallel training step and a compute-only matmul); the predictions are :mod:`labkit.theory.scaling`.
"""

from __future__ import annotations

import pandas as pd

from labkit.chapters.common import check_fits_in_memory, check_world_size
from labkit.checks import positive_int
from labkit.theory.scaling import cases_for
from labkit.theory.spec import get_spec


def check_chapter(*, world_size: int, model: str, seq_len: int, strong_total: int, weak_per_rank: int,
                  matmul_size: int, repeats: int, threads_per_rank: int, backend: str) -> list[int]:
    """Validate chapter 11's parameters before anything is launched (the chapter's first code cell). Returns the
    world sizes of the series: 1, 2, 4, ... up to ``world_size``.

    Raises ValueError naming the value and the fix: world_size < 2 (a series needs two points) or not a power
    of two, sizes < 1, ``strong_total`` not a multiple of world_size (every size of the series splits it),
    an unknown model, a model this machine's memory cannot hold on world_size ranks, or a backend the machine
    cannot run."""
    from labkit.runtime.launcher import resolve_backend

    world_size = check_world_size("11", world_size, why="a scaling series needs at least two world sizes")
    sizes = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= world_size]
    if sizes[-1] != world_size:
        raise ValueError(f"chapter 11's series doubles the world size (1, 2, 4, ...): world_size={world_size} is not "
                         f"in it; use {sizes[-1]} or {2 * sizes[-1]}")
    for name, value in (("seq_len", seq_len), ("matmul_size", matmul_size), ("repeats", repeats),
                        ("threads_per_rank", threads_per_rank)):
        positive_int(name, value)
    if positive_int("strong_total", strong_total) % world_size:
        raise ValueError(f"strong_total={strong_total} must split evenly over every world size of the series "
                         f"{sizes}, i.e. be a multiple of {world_size}: use {world_size}, {2 * world_size}, ...")
    cases_for(world_size, strong_total=strong_total, weak_per_rank=weak_per_rank)  # every size divides world_size
    spec = get_spec(model)
    spec.check_seq_len(seq_len)
    check_fits_in_memory(spec, max(sizes), copies=1, what="chapter 11's training series")
    resolve_backend(backend, max(sizes))
    return sizes


def format_table(df: pd.DataFrame) -> str:
    """A text table: each speedup and efficiency printed with its baseline and the ratio that makes it."""
    cols = ["experiment", "mode", "world_size", "work_per_rank", "total_work", "time_s", "baseline_world_size",
            "speedup", "speedup_formula", "efficiency", "efficiency_formula", "ideal_speedup", "ideal_speedup_on_cores"]
    if "mfu" in df.columns:
        cols += ["mfu", "mfu_denominator_flops"]
    show = df[[c for c in cols if c in df.columns]].copy()
    return show.to_string(index=False, float_format=lambda v: f"{v:.4g}")


