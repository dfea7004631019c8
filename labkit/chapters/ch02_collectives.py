"""Chapter 02 (collectives): its parameter check and the overlap verdict, a sentence written from the numbers.

What it launches is in :mod:`labkit.experiments.collectives` (the sweep, and :func:`~labkit.experiments.
collectives.measure`, one launch for everything) and :mod:`labkit.experiments.collective_patterns`
(AllReduce = ReduceScatter + AllGather, re-partition bytes, overlap); sizes are checked by
:mod:`labkit.theory.collectives`, the predictions come from :mod:`labkit.theory.costmodel`.
"""

from __future__ import annotations

import pandas as pd

from labkit.chapters.common import check_world_size
from labkit.checks import positive_int
from labkit.runtime.probes import cpu_cores
from labkit.theory.collectives import DTYPES, check_size, format_size, parse_ops, parse_size, plan, size_range


def check_chapter(*, world_size: int, ops, min_size, max_size, factor: int, warmup: int, repeats: int,
                  ar_size, repartition_size, overlap_size, n_matmuls: int = 32, matmul_size: int = 256,
                  backend: str = "auto") -> dict:
    """Validate chapter 02's parameters before anything is launched (the chapter's first code cell) and
    return the sizes its experiments will use.

    The sweep's range is kept as given (each size rounded down per op to one it accepts, as nccl-tests does
    with ``-b/-e``); ``ar_size``, ``repartition_size`` and ``overlap_size`` are rounded down the same way to
    the nearest size their ops accept on ``world_size`` ranks (reduce_scatter: a multiple of world_size
    elements; the re-partition: of world_size² elements), and ``notes`` says which were rounded.

    Returns ``{"ar_size": bytes, "repartition_size": bytes, "overlap_size": bytes, "sweep_sizes": {op:
    [bytes, ...]}, "notes": [str, ...]}``.

    Raises:
        ValueError: world_size < 2 (a collective needs a peer), an unknown op, a bad size or range, a range
            that gives fewer than 2 sizes for some op (the alpha-beta fit needs at least 2), factor < 2,
            warmup < 0, repeats < 1, n_matmuls or matmul_size < 1, or a backend the machine cannot run
            (:func:`labkit.runtime.launcher.resolve_backend`) — each naming the value and what would be valid.
    """
    from labkit.runtime.launcher import resolve_backend

    world_size = check_world_size("02", world_size, why="a collective moves data between ranks, and with one "
                                  "rank nothing crosses a link")
    op_list = parse_ops(ops)
    sizes = size_range(min_size, max_size, factor)
    positive_int("warmup", warmup, minimum=0)
    positive_int("repeats", repeats)
    positive_int("n_matmuls", n_matmuls)
    positive_int("matmul_size", matmul_size)
    sweep_sizes = {}
    for op, nbytes, _ in plan(op_list, sizes, world_size, align=True):
        sweep_sizes.setdefault(op, []).append(nbytes)
    for op, got in sweep_sizes.items():
        if len(got) < 2:
            raise ValueError(f"min_size={min_size!r}, max_size={max_size!r}, factor={factor} give {op} only "
                             f"{len(got)} size ({got[0]} bytes on {world_size} ranks); the alpha-beta fit needs at "
                             f"least 2: raise max_size to at least {format_size(got[0] * factor)}")
    notes, out = [], {}
    for name, value, op, unit_elems in (("ar_size", ar_size, "reduce_scatter", world_size),
                                        ("repartition_size", repartition_size, "all_to_all",
                                         world_size * world_size),
                                        ("overlap_size", overlap_size, "all_reduce", 1)):
        nbytes = parse_size(value, name)
        unit = unit_elems * DTYPES["float32"]
        if nbytes < unit:
            raise ValueError(f"{name}={value!r} is smaller than one {op} unit on {world_size} ranks ({unit} "
                             f"bytes of float32); use at least {unit}")
        out[name] = nbytes // unit * unit
        if out[name] != nbytes:
            notes.append(f"{name}={value!r} ({nbytes} bytes) rounded down to {out[name]} bytes: {op} on "
                         f"{world_size} ranks needs a multiple of {unit} bytes")
    check_size("reduce_scatter", out["ar_size"], world_size)
    check_size("reduce_scatter", out["repartition_size"], world_size)
    check_size("all_to_all", out["repartition_size"] // world_size, world_size)
    resolve_backend(backend, world_size)
    return {**out, "sweep_sizes": sweep_sizes, "notes": notes}


#: hidden_fraction an overlapped run must reach when its compute outlasts its communication and every rank
#: has a core of its own (chapter 02's check). Observed on a shared 2-core machine with 2 ranks: >= 0.9.
MIN_HIDDEN_FRACTION = 0.2

#: an oversubscribed run's verdict blames the shared cores only when the hidden fraction is below this share
#: of the predicted bound (min(1, compute / comm)); closer to the bound there is nothing to explain.
CROWDED_SHORTFALL = 0.8


def overlap_verdict(summary: pd.DataFrame, *, world_size: int, backend: str = "gloo",
                    cores: int | None = None) -> dict:
    """What an :func:`labkit.experiments.collective_patterns.overlap_summary` shows, as numbers and one sentence
    written from them.

    * ``hidden_fraction`` — measured: 1 − exposed comm (overlapped) / comm (serialised);
    * ``predicted_max_hidden_fraction`` — predicted upper bound ``min(1, compute_s / comm_s)`` from the
      serialised steps: an overlapped step can hide at most as much communication as it has compute to hide it
      behind (the ``max(compute, comm)`` model of an overlapped step, as in overlapping DDP's gradient
      all-reduce with backward: Li et al. 2020, "PyTorch Distributed", sec. 3.2.3);
    * ``compute_covers_comm`` — the serialised compute lasted at least as long as the communication, so
      overlap could hide all of it;
    * ``oversubscribed`` — gloo with more ranks than ``cores`` (default
      :func:`labkit.runtime.probes.cpu_cores`): a rank's communication thread then waits for a core while the
      matmuls run, so less can hide (the sentence says so only when the run hid less than
      :data:`CROWDED_SHORTFALL` of the bound);
    * ``required_hidden_fraction`` — what the chapter's check asks for when ``compute_covers_comm``:
      :data:`MIN_HIDDEN_FRACTION`, or just more than 0 (overlapped exposes less than serialised) when
      oversubscribed; ``hides`` — the run met it; ``checked`` — whether a chapter should assert ``hides``:
      compute covers the communication and every rank has a core (oversubscribed, a run may hide nothing);
    * ``conclusion`` — the sentence.

    Raises ValueError when the summary lacks the ``serialised`` or ``overlapped`` row, or world_size < 1."""
    world_size = positive_int("world_size", world_size)
    s = summary.set_index("mode")
    if not {"serialised", "overlapped"} <= set(s.index):
        raise ValueError(f"summary has modes {sorted(s.index)}; expected serialised and overlapped "
                         "(from overlap_summary)")
    cores = cpu_cores() if cores is None else positive_int("cores", cores)
    comp, comm = float(s.loc["serialised", "compute_s"]), float(s.loc["serialised", "comm_s"])
    hidden = float(s.loc["overlapped", "hidden_fraction"])
    bound = min(1.0, comp / comm) if comm > 0 else float("nan")
    over = backend == "gloo" and world_size > cores
    required = 0.0 if over else MIN_HIDDEN_FRACTION
    out = {"hidden_fraction": hidden, "predicted_max_hidden_fraction": bound,
           "compute_covers_comm": comp >= comm, "oversubscribed": over, "required_hidden_fraction": required,
           "hides": hidden > required if over else hidden >= required,
           # the chapter asserts ``hides`` only where physics promises it: enough compute, a core per rank
           "checked": comp >= comm and not over,
           "serialised_exposed_ms": float(s.loc["serialised", "exposed_comm_s"]) * 1e3,
           "overlapped_exposed_ms": float(s.loc["overlapped", "exposed_comm_s"]) * 1e3}
    numbers = (f"compute {comp * 1e3:.1f} ms beside an all-reduce of {comm * 1e3:.1f} ms (serialised, measured); "
               f"exposed communication {out['serialised_exposed_ms']:.1f} ms serialised vs "
               f"{out['overlapped_exposed_ms']:.1f} ms overlapped: {hidden:.0%} hidden (measured; at most "
               f"{bound:.0%} can hide, predicted)")
    if out["hides"]:
        verdict = "In this run overlap hid communication: "
    elif not out["compute_covers_comm"]:
        verdict = ("In this run overlap could not hide much, as there was less compute than communication to hide "
                   "it behind: ")
    else:
        verdict = ("In this run overlap did NOT hide the communication, although the compute was long enough: "
                   "the all-reduce's worker thread competed with the matmul for the cores: ")
    # the crowding explanation only where the run fell short: well below what could hide (the bound)
    short_of_bound = bound == bound and hidden < CROWDED_SHORTFALL * bound
    if over and short_of_bound:
        crowd = (f" {world_size} ranks share {cores} cores, so each rank's communication thread waits for a core "
                 f"while the matmuls run: the likely reason less hid than the {bound:.0%} that could.")
    elif over:
        crowd = (f" {world_size} ranks share {cores} cores, yet in this run that did not keep the overlap from "
                 "hiding close to what it could.")
    else:
        crowd = ""
    out["conclusion"] = verdict + numbers + "." + crowd
    return out


