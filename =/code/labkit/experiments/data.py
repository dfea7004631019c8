"""Replicated data parallelism, measured: the variants of :mod:`labkit.parallel.data` trained side by side
(:func:`run_rank`), the gradient-accumulation field case in hand-checkable numbers (:func:`accumulation_demo`)
and the local-batch sweep that shows when adding ranks stops paying (:func:`scaling_rank`).

Every function here whose first argument is ``ctx`` is a rank function for :func:`labkit.launch`.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn

from labkit.checks import positive_int
from labkit.experiments.common import run_experiments
from labkit.models import make_optimizer
from labkit.parallel.data import DEFAULT_BUCKET_CAP_BYTES, DataParallelBucket, DataParallelNaive, torch_ddp
from labkit.runtime.training import _unwrap, train_steps

VARIANTS = ("naive", "bucket", "ddp")


# ------------------------------------------------------------------------------------------------------
# builders for run_experiments, and the rank function that trains them
# ------------------------------------------------------------------------------------------------------
def build(variant: str, module: nn.Module, ctx, *, lr: float = 1e-3, group=None,
          bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, log_comm: bool = True):
    """Wrap ``module`` as ``variant`` (one of :data:`VARIANTS`) and build the lab's AdamW over its
    parameters. Returns (wrapped, optimizer). Raises ValueError for an unknown variant."""
    from labkit.checks import check_choice

    check_choice("variant", variant, VARIANTS)
    if variant == "naive":
        wrapped = DataParallelNaive(module, ctx=ctx, group=group)
    elif variant == "bucket":
        wrapped = DataParallelBucket(module, ctx=ctx, group=group, bucket_cap_bytes=bucket_cap_bytes)
    else:
        wrapped = torch_ddp(module, ctx=ctx, group=group, bucket_cap_bytes=bucket_cap_bytes, log_comm=log_comm)
    return wrapped, make_optimizer(module.parameters(), lr)


#: variant -> builder ``fn(module, ctx, **options) -> (wrapped, optimizer)`` for run_experiments
WRAPPERS = {v: functools.partial(build, v) for v in VARIANTS}


def run_rank(ctx, runs: list[dict] | None = None, **kwargs) -> list[dict]:
    """Rank function: :func:`labkit.experiments.common.run_experiments` over the data-parallel variants.

    ``runs`` defaults to one run of each of :data:`VARIANTS`; keyword arguments are run_experiments'
    (model, steps, global_batch_size, seq_len, n_microbatches, lr, seed, bucket_cap_bytes, ...).
    Example: ``launch(labkit.experiments.data.run_rank, 2, runs=[{"variant": "bucket"}], steps=3)``.
    """
    runs = [{"variant": v} for v in VARIANTS] if runs is None else runs
    return run_experiments(ctx, WRAPPERS, runs, **kwargs)


# ------------------------------------------------------------------------------------------------------
# the accumulation field case, in numbers small enough to check by hand
# ------------------------------------------------------------------------------------------------------
class _Scalar(nn.Module):
    """One parameter w; forward(g) = g · w, so d(output)/dw = g exactly."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))

    def forward(self, g):
        return (g * self.w).sum()


#: per rank, per micro-batch gradients of the demo; syncing on micro-batch 0 instead of the last leaves rank 0
#: with (1+3)/2 + 2 = 4.0 and rank 1 with (1+3)/2 + 5 = 7.0, where both should hold (1+2+3+5)/2 = 5.5
DEMO_GRADS = ((1.0, 2.0), (3.0, 5.0))


def demo_grads(world_size: int) -> tuple:
    """:data:`DEMO_GRADS` for 2 ranks; for other sizes rank r gets (1 + 2r, 2 + 3r) (two micro-batches).
    Raises ValueError for world_size < 1."""
    n = positive_int("world_size", world_size)
    return DEMO_GRADS if n == 2 else tuple((1.0 + 2 * r, 2.0 + 3 * r) for r in range(n))


def accumulation_demo(ctx, variant: str = "ddp", sync_microbatch: int | None = None,
                      grads: tuple | None = None) -> float:
    """Rank function: gradient accumulation over ``len(grads[rank])`` micro-batches of a one-parameter model
    whose micro-batch gradient on rank r is exactly ``grads[r][mb]``. Every micro-batch but
    ``sync_microbatch`` (default: the last, which is correct) runs inside ``no_sync()``. Returns this rank's
    accumulated gradient after the loop.

    Correct: every rank holds sum over micro-batches of the rank-average, sum_mb mean_r g[r][mb] (5.5 for
    :data:`DEMO_GRADS`). Sync on micro-batch 0: rank r holds mean_r g[r][0] + sum_{mb>0} g[r][mb] — ranks
    disagree (4.0 vs 7.0 for the demo numbers, the pattern of a public bug report about DDP ``no_sync``).
    ``grads`` defaults to :func:`demo_grads` (world_size). Raises ValueError if ``grads`` does not have one row
    per rank or its rows differ in length.
    """
    grads = demo_grads(ctx.world_size) if grads is None else grads
    if len(grads) != ctx.world_size or len({len(g) for g in grads}) != 1:
        raise ValueError(f"grads needs {ctx.world_size} rows of equal length (one per rank), got {grads!r}")
    m = len(grads[0])
    sync_microbatch = m - 1 if sync_microbatch is None else sync_microbatch
    model, _opt = build(variant, _Scalar().to(ctx.device), ctx)
    for mb in range(m):
        g = torch.tensor([grads[ctx.rank][mb]], device=ctx.device)
        cm = model.no_sync() if mb != sync_microbatch else contextlib.nullcontext()
        with cm:
            model(g).backward()
            if hasattr(model, "finish_grad_sync"):
                model.finish_grad_sync()
    if hasattr(model, "close"):
        model.close()
    return float(_unwrap(model).w.grad)


def accumulation_demo_rank(ctx, variants=VARIANTS) -> dict:
    """Rank function: :func:`accumulation_demo` for each variant, syncing on the last micro-batch (correct)
    and on the first (the bug). Returns {variant: {"correct": grad, "wrong": grad}} for this rank."""
    return {v: {"correct": accumulation_demo(ctx, v), "wrong": accumulation_demo(ctx, v, 0)} for v in variants}


# ------------------------------------------------------------------------------------------------------
# when adding ranks stops paying: the local-batch sweep
# ------------------------------------------------------------------------------------------------------
def scaling_rank(ctx, local_batch_sizes=(1, 2, 4, 8), *, model: str = "lab-tiny-llama", seq_len: int = 64,
                 steps: int = 3, variant: str = "ddp", bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                 seed: int = 0) -> list[dict]:
    """Rank function: for each local batch size b, the measured step time of (a) every rank training its own
    copy on b sequences with no communication (``compute_s``: what each rank's share of the work costs, with
    all ranks busy at once) and (b) data-parallel training with ``variant`` on a global batch of n·b
    (``dp_s``). Medians over ``steps`` timed steps after one warm-up step.

    Returns one dict per b: ``local_batch_size``, ``compute_s``, ``dp_s``, ``comm_s`` = dp_s - compute_s (the
    communication left exposed), ``efficiency`` = compute_s / dp_s (1 = communication fully hidden or free),
    ``tokens_per_s`` (global, data parallel), ``tokens_per_s_per_rank``. Raises ValueError for a non-positive
    local batch size, steps or bucket size, an unknown variant or model.
    """
    import statistics

    from labkit.models import SyntheticLM, build_model
    from labkit.theory.spec import get_spec

    spec = get_spec(model)
    data_ = SyntheticLM(spec.vocab_size, seq_len)
    n = ctx.world_size
    out = []
    for b in local_batch_sizes:
        b = positive_int("local_batch_size", b)
        plain = build_model(spec, seed, device=ctx.device)
        r_local = train_steps(ctx, plain, make_optimizer(plain.parameters()), data_, steps=steps,
                              warmup_steps=1, global_batch_size=b, dp_rank=0, dp=1, record=False)
        wrapped, opt = build(variant, build_model(spec, seed, device=ctx.device), ctx,
                             bucket_cap_bytes=bucket_cap_bytes, log_comm=False)
        r_dp = train_steps(ctx, wrapped, opt, data_, steps=steps, warmup_steps=1, global_batch_size=b * n,
                           record=False)
        if hasattr(wrapped, "close"):
            wrapped.close()
        c, d = statistics.median(r_local["step_s"]), statistics.median(r_dp["step_s"])
        out.append({"local_batch_size": b, "compute_s": c, "dp_s": d, "comm_s": d - c, "efficiency": c / d,
                    "tokens_per_s": b * n * seq_len / d, "tokens_per_s_per_rank": b * seq_len / d})
    return out
