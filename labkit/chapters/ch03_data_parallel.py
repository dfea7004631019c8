"""Chapter 03 (data parallelism: naive, bucketed, DDP): its parameter check, the one rank function it
launches, and the sentences it prints about the scaling sweep.

The strategies are in :mod:`labkit.parallel.data`, their formulas in :mod:`labkit.theory.data`, the runs in
:mod:`labkit.experiments.data`.
"""

from __future__ import annotations

from labkit.chapters.common import check_fits_in_memory, check_world_size
from labkit.checks import positive_int
from labkit.experiments.data import accumulation_demo_rank, run_rank, scaling_rank
from labkit.parallel.data import DEFAULT_BUCKET_CAP_BYTES
from labkit.theory.data import check_batch


def check_chapter(*, world_size, model: str = "lab-tiny-llama", global_batch_size=8, n_microbatches=2, steps=4,
                  seq_len=64, bucket_cap_bytes=DEFAULT_BUCKET_CAP_BYTES, scaling_batch_sizes=(1, 2, 4, 8),
                  scaling_steps=2) -> dict:
    """Chapter 03's parameters, all checked before any launch (the chapter's first cell after its parameters).

    world_size >= 2 (with one rank there is nothing to average, and the wrong-sync run cannot differ from the
    right one); a known ``model`` small enough for the machine; ``steps`` >= 1; world_size divides
    ``global_batch_size``; ``n_microbatches`` >= 2 (the accumulation runs, and the bug of syncing on the wrong
    micro-batch, need two) and divides the local batch; ``seq_len`` within the model's ``max_seq_len``;
    positive ``bucket_cap_bytes`` and ``scaling_steps``; one or more positive local batch sizes. Returns the
    checked values (``local_batch_size`` added). Raises ValueError naming the value and the fix.
    """
    from labkit.theory.spec import get_spec

    n = check_world_size("03", world_size, why="with one rank there is no gradient to average, and the "
                                 "wrong-sync run cannot leave ranks disagreeing")
    spec = get_spec(model)
    steps = positive_int("steps", steps)
    m = positive_int("n_microbatches", n_microbatches)
    if m < 2:
        raise ValueError(f"n_microbatches={m}: chapter 03's accumulation runs need n_microbatches >= 2 (the bug it "
                         "reproduces syncs on micro-batch 0 instead of the last); use n_microbatches=2")
    local = check_batch(n, global_batch_size, m, dp_name="world_size")
    seq_len = spec.check_seq_len(seq_len)
    positive_int("bucket_cap_bytes", bucket_cap_bytes)
    sizes = tuple(positive_int(f"scaling_batch_sizes[{i}]", b) for i, b in enumerate(scaling_batch_sizes or ()))
    if not sizes:
        raise ValueError(f"scaling_batch_sizes={scaling_batch_sizes!r} is empty: give at least one local batch "
                         "size, e.g. (1, 2, 4, 8)")
    positive_int("scaling_steps", scaling_steps)
    check_fits_in_memory(spec, n, copies=2, what="chapter 03")
    return {"world_size": n, "model": spec.name, "global_batch_size": global_batch_size, "n_microbatches": m,
            "local_batch_size": local, "steps": steps, "seq_len": seq_len, "scaling_batch_sizes": sizes}


def chapter_rank(ctx, runs: list[dict] | None = None, *, scaling_batch_sizes=(1, 2, 4, 8), scaling_steps: int = 2,
                 **kwargs) -> dict:
    """Rank function for chapter 03, so one launch does all of it: the training variants (:func:`run_rank`
    with ``runs`` and ``kwargs``), the hand-checkable accumulation demo (:func:`accumulation_demo_rank`) and
    the local-batch sweep (:func:`scaling_rank`, with the training runs' ``model``, ``seq_len`` and ``seed``;
    skipped when ``scaling_batch_sizes`` is empty).
    Returns {"runs": [...], "demo": {...}, "scaling": [...]}; :func:`labkit.experiments.common.summarize` and
    :func:`labkit.experiments.common.exposure_table` accept the LaunchResult directly."""
    out = {"runs": run_rank(ctx, runs, **kwargs), "demo": accumulation_demo_rank(ctx)}
    same = {k: kwargs[k] for k in ("model", "seq_len", "seed") if k in kwargs}  # the training runs' own values
    out["scaling"] = (scaling_rank(ctx, scaling_batch_sizes, steps=scaling_steps, **same)
                      if scaling_batch_sizes else [])
    return out


def scaling_findings(rows) -> str:
    """What :func:`scaling_rank`'s sweep showed, as sentences computed from its rows (nothing assumed).

    ``rows``: dicts (or a DataFrame's records) with ``local_batch_size`` and ``efficiency``. Sorted by local
    batch, the efficiencies either rise (each at least the one before), fall, or move both ways; the sentence
    says which, with the numbers, and only in the first case that the sweep shows the expected trend (compute
    grows with the batch, the all-reduce does not: Li et al. 2020, sec. 5). Raises ValueError for no rows or a
    row without those keys."""
    rows = list(rows.to_dict("records") if hasattr(rows, "to_dict") else rows)
    if not rows:
        raise ValueError("scaling_findings() got no rows; expected scaling_rank's rows (local_batch_size, efficiency)")
    missing = [k for k in ("local_batch_size", "efficiency") if any(k not in r for r in rows)]
    if missing:
        raise ValueError(f"scaling_findings() rows lack {missing}; expected scaling_rank's rows")
    rows = sorted(rows, key=lambda r: r["local_batch_size"])
    b = [int(r["local_batch_size"]) for r in rows]
    e = [float(r["efficiency"]) for r in rows]
    listed = ", ".join(f"b={x}: {y:.2f}" for x, y in zip(b, e))
    text = f"Measured efficiency (compute_s / dp_s) by local batch: {listed}."
    if len(e) < 2:
        return text + " One local batch size: no trend to read; give scaling_batch_sizes more values."
    steps = [y - x for x, y in zip(e, e[1:])]
    if all(d >= 0 for d in steps):
        return text + (" In this run efficiency rose with the local batch, as the model predicts: the compute grows "
                       "with b, the all-reduce's bytes do not.")
    if all(d <= 0 for d in steps):
        return text + (" In this run efficiency FELL with the local batch, against the model: at these sizes the "
                       "timings are milliseconds and noise from other processes dominates; re-run, or raise "
                       "seq_len or the batch sizes.")
    return text + (f" In this run efficiency shows no monotone trend ({e[0]:.2f} at the smallest batch, {e[-1]:.2f} "
                   "at the largest): at these sizes the timings are milliseconds and noise from other processes "
                   "outweighs the effect; re-run, or raise seq_len or the batch sizes to see it.")
