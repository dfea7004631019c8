"""Strong and weak scaling of any experiment, with the baseline and the denominator of every ratio named.

* **Strong scaling** keeps the total work fixed and spreads it over more ranks: each of ``n`` ranks does
  ``total / n``. Ideal: the time falls as ``n0 / n``.
* **Weak scaling** keeps the work per rank fixed: ``n`` ranks do ``n`` times the work. Ideal: the time stays
  flat.

For both, with the baseline run at ``n0`` ranks (the smallest world size of the series unless chosen):

* ``speedup = throughput(n) / throughput(n0)`` where throughput = total work / time. Strong: ``T(n0) / T(n)``
  (same work); weak: ``(n / n0) · T(n0) / T(n)`` (the "scaled speedup", Gustafson 1988, "Reevaluating
  Amdahl's law", CACM 31(5)).
* ``ideal_speedup = n / n0``; ``efficiency = speedup / ideal_speedup`` — strong: ``T(n0)·n0 / (T(n)·n)``
  (Amdahl 1967 regime), weak: ``T(n0) / T(n)``.

Every row carries ``baseline_world_size``, ``baseline_time_s`` and the ratio written out
(``speedup_formula``, ``efficiency_formula``), so no efficiency is printed without what it is relative to.

An *experiment* is a function ``experiment(ctx, work, **kwargs) -> step`` run inside each rank: it sets up
(model, data, optimizer — untimed) for ``work`` units of work on this rank and returns ``step()``, one timed
unit (a training step, a batch of matmuls) that returns this rank's counts, e.g. ``{"tokens": 2048,
"flops": 1.2e10}`` (any keys; they are summed over ranks). The runner warms up, then times ``repeats`` steps,
each started after a barrier; a repeat lasts from the first rank's start to the last rank's end. Built in:
:func:`matmul_experiment` (compute only, no communication) and :func:`train_experiment` (the lab's model,
data parallel with torch DDP).

Recorded GPU series live in ``data/reference/scaling/`` (:func:`load_reference`); nothing is shown when
there is none — never an invented GPU number. What is predicted before a run (the cases of a series, the
training step's FLOPs and all-reduce bytes) is in :mod:`labkit.theory.scaling`; chapter 11's check and text
table in :mod:`labkit.chapters.ch11_scaling`.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd

from labkit.checks import check_choice, positive_int
from labkit.paths import data_dir
from labkit.runtime import records
from labkit.runtime.probes import cpu_cores
from labkit.theory.scaling import cases_for

REFERENCE_FORMAT = "labkit.scaling/v1"
NO_REFERENCE = ("no recorded GPU scaling series in data/reference/scaling/ - only this machine's numbers are "
                "shown. Record one on a GPU cluster with examples/slurm/scaling.sbatch.")
#: the columns of a measured series (one row per mode x world size)
ROW_FIELDS = ("experiment", "mode", "world_size", "work_per_rank", "total_work", "time_s", "time_min_s",
              "time_max_s", "repeats", "threads_per_rank", "cores", "backend")


# ------------------------------------------------------------------------------------------------------
# experiments (run inside ranks)
# ------------------------------------------------------------------------------------------------------
#: op names (torch.utils.flop_counter) of attention's own matmuls: sdpa's fused kernels where the counter knows them
#: (CUDA), and bmm, which in the lab's model only eager attention issues (q kᵀ and p v)
ATTENTION_OPS = ("attention", "aten.bmm")


def count_flops(fn) -> dict:
    """Run ``fn()`` under torch's ``FlopCounterMode`` (torch.utils.flop_counter: 2·M·N·K per matmul, forward
    and backward, counted from the shapes of the ops that actually ran; elementwise ops count nothing).
    Returns ``flops_counted`` (all), ``flops_counted_attention`` (the ops of :data:`ATTENTION_OPS`) and
    ``flops_counted_matmul`` (the rest: the matmuls with weights). On CPU the counter has no rule for the fused
    ``scaled_dot_product_attention`` kernel, so sdpa's attention FLOPs are not in the count there."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    by_op = {str(k): int(v) for k, v in counter.get_flop_counts().get("Global", {}).items()}
    attention = sum(v for k, v in by_op.items() if any(a in k for a in ATTENTION_OPS))
    total = int(counter.get_total_flops())
    return {"flops_counted": float(total), "flops_counted_attention": float(attention),
            "flops_counted_matmul": float(total - attention)}


def matmul_experiment(ctx, work: int, size: int = 256):
    """Compute only: ``work`` products of two ``size`` x ``size`` float32 matrices per step, no communication.
    Counts: ``matmuls``, ``flops`` (the formula, 2·size³ each) and ``flops_counted`` (torch's FlopCounterMode on
    one product, x ``work``: :func:`count_flops`)."""
    import torch

    work = positive_int("work", work)
    size = positive_int("size", size)
    g = torch.Generator().manual_seed(ctx.rank)
    a = torch.randn(size, size, generator=g).to(ctx.device)
    b = torch.randn(size, size, generator=g).to(ctx.device)
    counted = count_flops(lambda: a @ b)["flops_counted"] * work

    def step():
        c = a
        for _ in range(work):
            c = a @ b
        ctx.sync()
        del c
        return {"matmuls": work, "flops": 2.0 * size**3 * work, "flops_counted": counted}

    return step


def train_experiment(ctx, work: int, model: str = "lab-tiny-llama", seq_len: int = 32, lr: float = 1e-3,
                     seed: int = 0):
    """One training step of the lab's model on ``work`` sequences of ``seq_len`` tokens per rank, data
    parallel with ``torch.nn.parallel.DistributedDataParallel`` (gradients all-reduced in buckets during
    backward), AdamW. Counts: ``sequences``, ``tokens``, ``flops`` (the formula: tokens ×
    :func:`labkit.theory.spec.flops_per_token`, training: PaLM Appendix B; the MFU convention) and, independent
    of it, what torch's FlopCounterMode counted in one forward + backward of this very model on this batch
    (:func:`count_flops`, before the timed steps: ``flops_counted``, ``flops_counted_matmul``,
    ``flops_counted_attention``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from labkit.models import SyntheticLM, build_model, flops_per_token, lm_loss, make_optimizer

    work = positive_int("work", work)
    net = build_model(model, seed=seed, device=ctx.device)
    spec = net.spec
    data = SyntheticLM(spec.vocab_size, seq_len, seed)
    tokens, targets = data.batch(ctx.rank, work)
    tokens, targets = tokens.to(ctx.device), targets.to(ctx.device)
    counted = count_flops(lambda: lm_loss(net(tokens), targets).backward())  # the module alone: no DDP hooks yet
    net.zero_grad(set_to_none=True)
    ddp = DDP(net, device_ids=[ctx.device.index] if ctx.is_cuda else None)
    opt = make_optimizer(ddp.parameters(), lr)
    fpt = flops_per_token(spec, seq_len, training=True)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(ddp(tokens), targets)
        loss.backward()
        opt.step()
        ctx.sync()
        n = work * seq_len
        return {"sequences": work, "tokens": n, "flops": n * fpt, **counted}

    return step


EXPERIMENTS: dict[str, Callable] = {"matmul": matmul_experiment, "train": train_experiment}


def resolve_experiment(experiment) -> Callable:
    """A callable, a built-in name (:data:`EXPERIMENTS`) or ``"module:function"`` -> the function.
    Raises ValueError for an unknown name."""
    if callable(experiment):
        return experiment
    if isinstance(experiment, str) and ":" in experiment:
        from labkit.runtime.worker import resolve_function

        return resolve_function(experiment)
    check_choice("experiment", experiment, EXPERIMENTS)
    return EXPERIMENTS[experiment]


def _experiment_name(experiment) -> str:
    if isinstance(experiment, str):
        return experiment
    return getattr(experiment, "__name__", repr(experiment))


# ------------------------------------------------------------------------------------------------------
# the rank function
# ------------------------------------------------------------------------------------------------------
def series_rank(ctx, jobs: Sequence[dict], warmup: int = 1, repeats: int = 3) -> dict:
    """Rank function. ``jobs``: ``[{"experiment", "kwargs", "cases"}]`` (cases from
    :func:`labkit.theory.scaling.cases_for`). For each case: set the experiment up for ``work_per_rank``
    units, run ``warmup`` untimed steps, then ``repeats`` timed steps (barrier, clock, step, device sync,
    clock), each recorded on the timeline as ``"<experiment> <mode>"``. A repeat lasts from the first rank's
    start to the last rank's end (on rank 0's clock: each rank's clock offset is subtracted); counts are
    summed over ranks.

    Returns ``{"rows": [...], "rank", "node_rank", "clock_offset_ns", "threads"}``."""
    import torch
    import torch.distributed as dist

    from labkit.runtime.timeline import now_ns

    rows = []
    for job in jobs:
        fn = resolve_experiment(job["experiment"])
        name = _experiment_name(job["experiment"])
        for case in job["cases"]:
            step = fn(ctx, case["work_per_rank"], **dict(job.get("kwargs") or {}))
            for _ in range(warmup):
                step()
            times, counts = [], {}
            for i in range(positive_int("repeats", repeats)):
                ctx.barrier()
                t0 = now_ns()
                with ctx.timer(f"{name} {case['mode']}", "compute", step=i):
                    counts = step() or {}
                t1 = now_ns()
                # the step lasts from the first rank's start to the last rank's end, on rank 0's clock (ranks
                # that share cores do not run at once: the slowest rank's own duration would be too short)
                off = ctx.clock_offset_ns
                ends = torch.tensor([float(t1 - off), -float(t0 - off)], dtype=torch.float64, device=ctx.device)
                dist.all_reduce(ends, op=dist.ReduceOp.MAX)
                times.append(float(ends[0] + ends[1]) / 1e9)
            keys = sorted(counts)
            tot = torch.tensor([float(counts[k]) for k in keys] or [0.0], dtype=torch.float64, device=ctx.device)
            dist.all_reduce(tot)
            t = sorted(times)
            rows.append({"experiment": name, **case, "time_s": statistics.median(t), "time_min_s": t[0],
                         "time_max_s": t[-1], "repeats": len(t),
                         **{k: float(v) for k, v in zip(keys, tot.tolist())}})
            del step
    return {"rows": rows, "rank": ctx.rank, "node_rank": ctx.node_rank, "clock_offset_ns": ctx.clock_offset_ns,
            "threads": torch.get_num_threads()}


def torchrun_point(ctx, experiment: str = "train", strong_total: int | None = None,
                   weak_per_rank: int | None = None, warmup: int = 1, repeats: int = 3, **kwargs) -> dict:
    """The same measurement under ``torchrun`` (JSON keyword arguments; one world size per run: the one
    torchrun started). ``torchrun ... -m labkit.runtime.worker labkit.experiments.scaling:torchrun_point --kwargs
    '{"experiment": "train", "strong_total": 16, "weak_per_rank": 4}' --out DIR``; read the runs back with
    :func:`from_torchrun`."""
    cases = cases_for(ctx.world_size, strong_total=strong_total, weak_per_rank=weak_per_rank)
    return series_rank(ctx, [{"experiment": experiment, "kwargs": kwargs, "cases": cases}], warmup, repeats)


# ------------------------------------------------------------------------------------------------------
# notebook side
# ------------------------------------------------------------------------------------------------------
def _rows_of(out: dict, world_size: int, backend: str, cores: int) -> list[dict]:
    return [{"world_size": world_size, "threads_per_rank": out["threads"], "cores": cores, "backend": backend, **r,
             "source": "measured"} for r in out["rows"]]


def _jobs(experiments, kwargs: dict) -> list[dict]:
    """``"train"`` / a function / ``"module:function"`` (with ``kwargs``), or a dict name -> kwargs for several
    experiments in the same launches."""
    if isinstance(experiments, dict):
        if kwargs:
            raise ValueError(f"give each experiment's keyword arguments in the experiments dict, not as "
                             f"{', '.join(sorted(kwargs))}=...")
        items = list(experiments.items())
    else:
        items = [(experiments, kwargs)]
    if not items:
        raise ValueError("experiments is empty; give one, e.g. 'train', or a dict such as {'train': {}}")
    for exp, _ in items:
        resolve_experiment(exp)
    return [{"experiment": exp, "kwargs": dict(kw or {})} for exp, kw in items]


def run(experiments="train", world_sizes: Sequence[int] = (1, 2, 4), *, strong_total: int | None = None,
        weak_per_rank: int | None = None, warmup: int = 1, repeats: int = 3, threads_per_rank: int | None = None,
        backend: str = "auto", timeout_s: float = 300.0, baseline_world_size: int | None = None,
        **kwargs) -> pd.DataFrame:
    """Measure strong and/or weak scaling series: one :func:`labkit.launch` per world size (fresh ranks, so
    one size cannot warm the next), each running every experiment in every mode.

    ``experiments``: a built-in name (``"train"``, ``"matmul"``), ``"module:function"`` or a function (see the
    module docstring), whose keyword arguments are ``kwargs``; or a dict ``{experiment: kwargs}`` for several.
    ``strong_total`` / ``weak_per_rank``: work units (the experiment's ``work``). ``threads_per_rank``: torch
    threads per rank (default: launch's ``cores // world_size``; 1 makes each rank one core, as one GPU per
    rank).

    Returns :func:`efficiency` of the measured rows (``source`` = measured: times and counts; the ``ideal_*``
    columns are *predicted*), with ``attrs["timelines"]`` (world_size -> timeline DataFrame).

    Raises ValueError before any launch: an unknown experiment, a world size that does not divide
    ``strong_total``, neither mode asked for, an empty series.
    """
    from labkit.runtime.launcher import launch

    sizes = [positive_int("world_size", w) for w in world_sizes]
    if not sizes:
        raise ValueError("world_sizes is empty; give at least one world size, e.g. (1, 2, 4)")
    jobs = _jobs(experiments, kwargs)
    plans = {w: cases_for(w, strong_total=strong_total, weak_per_rank=weak_per_rank) for w in sizes}
    rows, timelines = [], {}
    for w in sizes:
        res = launch(series_rank, w, [dict(j, cases=plans[w]) for j in jobs], warmup, repeats, backend=backend,
                     timeout_s=timeout_s, threads_per_rank=threads_per_rank)
        rows += _rows_of(res[0], w, res.backend, cpu_cores())
        timelines[w] = res.timeline
    df = efficiency(pd.DataFrame(rows), baseline_world_size)
    df.attrs["timelines"] = timelines
    return df


def efficiency(df: pd.DataFrame, baseline_world_size: int | None = None) -> pd.DataFrame:
    """Add, per (experiment, mode), relative to the run at ``baseline_world_size`` (default: the smallest
    world size of that series): ``baseline_world_size``, ``baseline_time_s``, ``throughput`` (total work / s),
    ``speedup`` = throughput(n) / throughput(n0), ``ideal_speedup`` = n / n0 (*predicted*: perfect scaling),
    ``efficiency`` = speedup / ideal_speedup, ``ideal_speedup_on_cores`` (*predicted*: on a CPU with C cores
    and one thread per rank, compute grows as min(n·threads, C), so speedup <= min(n·t, C) / min(n0·t, C)),
    and the ratios written out with their numbers (``speedup_formula``, ``efficiency_formula``).

    Raises ValueError if the baseline world size is not in a series."""
    out = []
    for _, g in df.groupby(["experiment", "mode"], sort=False):
        g = g.sort_values("world_size").copy()
        n0 = int(g["world_size"].min()) if baseline_world_size is None else int(baseline_world_size)
        base = g[g["world_size"] == n0]
        if base.empty:
            raise ValueError(f"baseline_world_size={n0} is not in the {g['mode'].iloc[0]} series; "
                             f"valid: {', '.join(map(str, g['world_size']))}")
        b = base.iloc[0]
        g["baseline_world_size"] = n0
        g["baseline_time_s"] = b["time_s"]
        g["throughput"] = g["total_work"] / g["time_s"]
        g["speedup"] = g["throughput"] / (b["total_work"] / b["time_s"])
        g["ideal_speedup"] = g["world_size"] / n0
        g["efficiency"] = g["speedup"] / g["ideal_speedup"]
        cap = g["threads_per_rank"] * g["world_size"]
        cap0 = b["threads_per_rank"] * n0
        g["ideal_speedup_on_cores"] = cap.clip(upper=g["cores"]) / min(cap0, b["cores"])
        if g["mode"].iloc[0] == "strong":
            g["speedup_formula"] = [f"T({n0})={b['time_s']:.4f}s / T({n})={t:.4f}s"
                                    for n, t in zip(g["world_size"], g["time_s"])]
        else:
            g["speedup_formula"] = [f"({n}/{n0}) x T({n0})={b['time_s']:.4f}s / T({n})={t:.4f}s"
                                    for n, t in zip(g["world_size"], g["time_s"])]
        g["efficiency_formula"] = [f"{s:.2f} / ({n}/{n0})" for s, n in zip(g["speedup"], g["world_size"])]
        out.append(g)
    return pd.concat(out, ignore_index=True)


def measure_peak(n: int = 768, repeats: int = 10, tries: int = 3, *, previous: dict | None = None) -> dict:
    """The machine's measured dense float32 matmul peak (:func:`labkit.models.measure_matmul_peak`: best of
    ``repeats``; here also best of ``tries`` such calls, since a peak is what the machine can do when nothing
    else runs), in this process. Returns (FLOP/s, *measured* unless said otherwise):

    * ``flops_1_thread`` — one core alone; ``flops_all_cores`` — every core together (one process, ``cores``
      threads; lower than ``cores`` x one core when something else runs, or when cores slow down together);
    * ``flops_machine`` — the MFU denominator: the larger of ``flops_all_cores`` and ``cores x flops_1_thread``
      (*derived*: no rank of a series can beat its core's peak, so an MFU against this stays <= 1 up to
      timing noise, whatever else ran while the all-cores peak was measured); ``machine_basis`` says which;
    * ``tries_1_thread`` — every try's one-thread peak (FLOP/s), and ``spread_1_thread`` = best / worst try
      (1.0 on a steady machine): how much the core's own speed moved while it was measured, the size of the
      timing noise an MFU against this peak carries (a shared or throttled machine shows 1.2-1.5).

    ``previous``: a dict this function returned earlier (e.g. before a long series); the result is the best of
    both measurements and keeps every try, so a peak measured before *and* after a series is not undercut by a
    machine that ran faster in between. Restores the thread count afterwards. Raises ValueError for
    ``n``, ``repeats`` or ``tries`` below 1."""
    import torch

    from labkit.models import measure_matmul_peak
    from labkit.runtime import zygote

    zygote.settle()  # the rank template, when it is starting, imports torch on a core we are about to time
    cores = cpu_cores()
    tries = positive_int("tries", tries)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ones = [measure_matmul_peak("cpu", n=n, repeats=repeats) for _ in range(tries)]
        torch.set_num_threads(cores)
        full = max(measure_matmul_peak("cpu", n=n, repeats=repeats) for _ in range(tries))
    finally:
        torch.set_num_threads(before)
    if previous is not None:
        ones = list(previous["tries_1_thread"]) + ones
        full = max(full, previous["flops_all_cores"])
    one = max(ones)
    if full >= cores * one:
        machine, basis = full, f"all {cores} cores together (measured)"
    else:
        machine, basis = cores * one, f"{cores} cores x one core alone (measured 1-thread peak x {cores})"
    return {"cores": cores, "flops_1_thread": one, "flops_all_cores": full, "flops_machine": machine,
            "machine_basis": basis, "tries_1_thread": ones, "spread_1_thread": one / min(ones)}


def with_mfu(df: pd.DataFrame, peak_flops: float, label: str = "machine peak (measured)") -> pd.DataFrame:
    """Add ``achieved_flops`` (FLOP/s: summed ``flops`` of one step / its time), ``mfu`` = achieved /
    ``peak_flops`` and the denominator beside it (``mfu_denominator_flops``, ``mfu_denominator``). Needs a
    ``flops`` column (the built-in experiments count them). Model FLOPs utilisation: PaLM, Appendix B."""
    if "flops" not in df.columns:
        raise ValueError("this series has no 'flops' column: the experiment's step() must count its FLOPs")
    out = df.copy()
    out["achieved_flops"] = out["flops"] / out["time_s"]
    out["mfu"] = out["achieved_flops"] / float(peak_flops)
    out["mfu_denominator_flops"] = float(peak_flops)
    out["mfu_denominator"] = label
    return out


# ------------------------------------------------------------------------------------------------------
# torchrun / Slurm runs and recorded series
# ------------------------------------------------------------------------------------------------------
def from_torchrun(out_dirs: Sequence[str | Path], baseline_world_size: int | None = None) -> pd.DataFrame:
    """The series from the folders that ``torchrun ... labkit.experiments.scaling:torchrun_point --out DIR`` wrote (one
    per world size), as :func:`run` returns it (with ``n_nodes``). Raises ValueError for a folder without a
    complete run (:func:`labkit.runtime.launcher.load_results`)."""
    from labkit.runtime.launcher import load_results

    rows = []
    for d in out_dirs:
        res = load_results(d)
        meta = json.loads((Path(d) / "meta.json").read_text())
        for r in _rows_of(res[0], res.world_size, res.backend, cpu_cores()):
            rows.append({**r, "n_nodes": meta.get("n_nodes", 1)})
    return efficiency(pd.DataFrame(rows), baseline_world_size)


def reference_dir() -> Path:
    return data_dir() / "reference" / "scaling"


def bad_reference_rows(df: pd.DataFrame) -> list[str]:
    """Why rows of a series must not become a recorded GPU reference: not measured on NCCL (a CPU series would
    be shown as GPU numbers), or a time that is not a positive number within its own min..max. One line per bad
    row; empty when every row may be recorded."""
    import math

    bad = []
    for r in df.to_dict("records"):
        what = f"{r.get('experiment')} {r.get('mode')} world_size={r.get('world_size')}"
        if r.get("backend") != "nccl":
            bad.append(f"{what}: backend {r.get('backend')!r}, not nccl")
        t, lo, hi = (float(r.get(k, float("nan"))) for k in ("time_s", "time_min_s", "time_max_s"))
        if not (math.isfinite(t) and 0 < lo <= t <= hi):
            bad.append(f"{what}: time_s={t} outside 0 < time_min_s={lo} <= time_s <= time_max_s={hi}")
    return bad


def write_reference(df: pd.DataFrame, identity: dict, path: str | Path) -> Path:
    """Write a measured GPU series as a recorded reference (``{"format", "identity", "rows"}``, format
    :data:`REFERENCE_FORMAT`), atomically. ``identity`` should name the GPUs, nodes, torch/NCCL versions and
    the git sha (:func:`labkit.runtime.records.identity`). Raises ValueError, writing nothing, when a row must
    not be recorded (:func:`bad_reference_rows`)."""
    bad = bad_reference_rows(df)
    if bad:
        raise ValueError(f"{len(bad)} row(s) must not be recorded as a GPU reference series, nothing written: "
                         + "; ".join(bad))
    keep = [c for c in df.columns if c in ROW_FIELDS or c in ("tokens", "flops", "sequences", "matmuls", "n_nodes")]
    return records.write_reference_doc(df[keep].to_dict("records"), identity, path, REFERENCE_FORMAT)


def load_reference(path: str | Path | None = None) -> pd.DataFrame:
    """Recorded GPU series: one file, or every ``*.json`` in data/reference/scaling/ (default), with
    :func:`efficiency` applied, ``source`` (file name) and ``gpu``; labelled *recorded elsewhere*. When there
    is none, an empty frame whose ``attrs["status"]`` is :data:`NO_REFERENCE`. Raises ValueError for a file
    in another format."""
    files = [Path(path)] if path is not None else sorted(reference_dir().glob("*.json"))
    return records.load_reference_frames(files, REFERENCE_FORMAT, columns=[*ROW_FIELDS, "speedup", "efficiency"],
                                         no_reference=NO_REFERENCE, transform=efficiency)
