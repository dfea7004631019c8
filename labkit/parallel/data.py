"""Replicated data parallelism: every rank holds the whole model and a slice of the batch, and gradients
are averaged over ranks before each optimizer step.

Three ways to do it, side by side:

* :class:`DataParallelNaive` — after the whole backward, one blocking ``all_reduce`` per gradient tensor.
  Simple; every byte of communication is exposed (nothing computes while it runs).
* :class:`DataParallelBucket` — gradients are packed into buckets (reverse parameter order, which is
  roughly the order backward produces them); a bucket's ``all_reduce`` is launched asynchronously from a
  gradient hook the moment its last gradient is ready, so communication overlaps the rest of backward
  (Li et al. 2020, "PyTorch Distributed", Sec. 3.2 and 4.2: bucketing and overlap).
* :func:`torch_ddp` — ``torch.nn.parallel.DistributedDataParallel`` (the C++ reducer doing the same), with
  an optional comm hook that logs each bucket's all-reduce.

All three divide by the group size and average, support gradient accumulation with ``no_sync()`` (forward
and backward inside it skip synchronisation, as in DDP), and follow the wrapper protocol of
:mod:`labkit.parallel.harness`.

Communication per step (ring all-reduce, Patarasuk & Yuan 2009): each rank sends 2(n-1)/n · Ψ · bytes per
element, for Ψ parameters — :func:`predicted_allreduce_bytes`.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.chapters.common import check_fits_in_memory, check_world_size
from labkit.checks import check_divides, positive_int
from labkit.experiments.common import run_experiments
from labkit.models import make_optimizer
from labkit.runtime.training import train_steps

VARIANTS = ("naive", "bucket", "ddp")
#: DDP's default bucket size (``bucket_cap_mb=25``), in bytes
DEFAULT_BUCKET_CAP_BYTES = 25 * 2**20
#: DDP's cap for the first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``): a small first bucket
#: lets the first all-reduce start as soon as the output layer's gradients exist
DEFAULT_FIRST_BUCKET_BYTES = 2**20


def predicted_allreduce_bytes(n_params: int, world_size: int, bytes_per_element: int = 4) -> float:
    """Bytes one rank sends per step to all-reduce Ψ = ``n_params`` gradients with the ring algorithm:
    2(n-1)/n · Ψ · bytes_per_element (Patarasuk & Yuan 2009; nccl-tests PERFORMANCE.md busbw factor;
    Rajbhandari et al. 2020, Sec. 7.1: "2Ψ" per step for DDP). Raises ValueError for n < 1."""
    n = positive_int("world_size", world_size)
    return 2 * (n - 1) / n * positive_int("n_params", n_params) * bytes_per_element


def broadcast_parameters(module: nn.Module, group=None) -> None:
    """Copy the group's first rank's parameters and buffers to every rank (as DDP does at construction),
    so replicas start identical even if the caller seeded differently."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=src, group=group)


class DataParallelNaive(nn.Module):
    """All-reduce every gradient, one blocking call per parameter, after backward.

    ``module``: the full model (same weights on every rank; broadcast from the group's first rank at
    construction). ``group``: the data-parallel process group (default: the world). Call
    :meth:`finish_grad_sync` after each backward (the harness does); it averages gradients unless that
    backward's forward ran inside :meth:`no_sync`.
    """

    def __init__(self, module: nn.Module, ctx=None, group=None):
        super().__init__()
        self.module = module
        self.ctx = ctx
        self.group = group
        self.n = dist.get_world_size(group)
        self.require_sync = True
        self._pending = False
        broadcast_parameters(module, group)

    def forward(self, *args, **kwargs):
        self._pending = self.require_sync and torch.is_grad_enabled()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Forward + backward inside this block accumulate gradients locally, without communication."""
        old, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = old

    def finish_grad_sync(self) -> None:
        """Average gradients over the group (blocking all-reduce per tensor), if the last forward asked."""
        if not self._pending:
            return
        for p in self.module.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=self.group)
                p.grad.div_(self.n)
        self._pending = False


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        p0 = params[0]
        self.buffer = torch.empty(self.numel, dtype=p0.dtype, device=p0.device)
        self.ready = 0
        self.work = None


class DataParallelBucket(nn.Module):
    """Bucketed, overlapped gradient all-reduce launched from gradient hooks.

    Parameters are grouped into buckets in reverse registration order (roughly the order backward produces
    their gradients); a bucket closes as soon as it holds at least ``bucket_cap_bytes`` (DDP's rule in
    ``compute_bucket_assignment_by_size``), the first one at ``first_bucket_cap_bytes`` (default: DDP's
    1 MiB, or ``bucket_cap_bytes`` if smaller). When a bucket's last gradient has been accumulated
    (``register_post_accumulate_grad_hook``), its gradients are copied into the bucket buffer, divided by
    n, and an asynchronous ``all_reduce`` is launched; buckets are launched strictly in index order so
    every rank issues the same sequence of collectives (as DDP's reducer does). :meth:`finish_grad_sync`
    waits and copies the averages back. Communication of early buckets overlaps the remaining backward.

    Raises ValueError for a non-positive bucket_cap_bytes.
    """

    def __init__(self, module: nn.Module, ctx=None, group=None, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                 first_bucket_cap_bytes: int | None = None):
        super().__init__()
        positive_int("bucket_cap_bytes", bucket_cap_bytes)
        first_cap = min(DEFAULT_FIRST_BUCKET_BYTES, bucket_cap_bytes) if first_bucket_cap_bytes is None else \
            positive_int("first_bucket_cap_bytes", first_bucket_cap_bytes)
        self.module = module
        self.ctx = ctx
        self.group = group
        self.n = dist.get_world_size(group)
        self.require_sync = True
        self._pending = False
        broadcast_parameters(module, group)
        params = [p for p in module.parameters() if p.requires_grad]
        self.buckets: list[_Bucket] = []
        cur: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):  # a bucket closes once it holds at least its cap (DDP's rule)
            cur.append(p)
            size += p.numel() * p.element_size()
            if size >= (bucket_cap_bytes if self.buckets else first_cap):
                self.buckets.append(_Bucket(cur))
                cur, size = [], 0
        if cur:
            self.buckets.append(_Bucket(cur))
        self._bucket_of = {}
        for i, b in enumerate(self.buckets):
            for p in b.params:
                self._bucket_of[p] = i
        self._next = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def forward(self, *args, **kwargs):
        self._pending = self.require_sync and torch.is_grad_enabled()
        return self.module(*args, **kwargs)

    no_sync = DataParallelNaive.no_sync

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._pending:
            return
        b = self.buckets[self._bucket_of[p]]
        b.ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].ready == len(self.buckets[self._next].params):
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, b: _Bucket) -> None:
        with torch.no_grad():
            off = 0
            for p in b.params:
                n = p.numel()
                if p.grad is None:
                    b.buffer[off:off + n].zero_()
                else:
                    b.buffer[off:off + n].copy_(p.grad.reshape(-1))
                off += n
            b.buffer.div_(self.n)
        work = dist.all_reduce(b.buffer, group=self.group, async_op=True)
        nbytes = b.numel * b.buffer.element_size()
        b.work = work if self.ctx is None else self.ctx.track_async(work, "all_reduce", nbytes)

    def finish_grad_sync(self) -> None:
        """Launch any bucket whose gradients never all arrived (unused parameters count as zero), wait for
        every bucket, and write the averaged gradients back into ``.grad``."""
        if not self._pending:
            return
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
            self._next += 1
        with torch.no_grad():
            for b in self.buckets:
                b.work.wait()
                off = 0
                for p in b.params:
                    n = p.numel()
                    flat = b.buffer[off:off + n].view_as(p)
                    if p.grad is None:
                        p.grad = flat.clone()
                    else:
                        p.grad.copy_(flat)
                    off += n
                b.ready, b.work = 0, None
        self._next = 0
        self._pending = False

    def close(self) -> None:
        """Remove the gradient hooks (the module can then be wrapped again)."""
        for h in self._handles:
            h.remove()
        self._handles = []


# ------------------------------------------------------------------------------------------------------
# torch DDP, optionally with a logging comm hook
# ------------------------------------------------------------------------------------------------------
class _HookState:
    def __init__(self, ctx, group):
        self.ctx = ctx
        self.group = group
        self.n = dist.get_world_size(group)


def logged_allreduce_hook(state: _HookState, bucket):  # no return annotation: DDP checks it literally
    """DDP comm hook equivalent to DDP's default (divide by n, then all-reduce the bucket), issued as
    ``dist.all_reduce`` so a :class:`~labkit.runtime.commlog.CommLog` counts it, and recorded on the timeline from
    issue to completion (``register_comm_hook``, torch.distributed.algorithms.ddp_comm_hooks)."""
    buf = bucket.buffer()
    buf.div_(state.n)
    work = dist.all_reduce(buf, group=state.group, async_op=True)
    if state.ctx is not None:
        state.ctx.track_async(work, "all_reduce", buf.numel() * buf.element_size())
    return work.get_future().then(lambda fut: fut.value()[0])


def torch_ddp(module: nn.Module, ctx=None, group=None, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
              log_comm: bool = True) -> nn.Module:
    """``DistributedDataParallel`` around ``module`` (on its device; CPU under gloo) with
    ``bucket_cap_mb = bucket_cap_bytes / 2**20``. With ``log_comm`` a comm hook
    (:func:`logged_allreduce_hook`) makes its all-reduces visible to CommLog and the timeline; without it
    DDP's own C++ hook runs (use that for speed comparisons). Raises ValueError for a non-positive
    bucket_cap_bytes."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    positive_int("bucket_cap_bytes", bucket_cap_bytes)
    device_ids = [module_device(module).index] if module_device(module).type == "cuda" else None
    import inspect

    # buffers (RoPE tables) are identical on every rank: sync them once at construction, not every forward
    no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(DDP).parameters
                      else {"broadcast_buffers": False})
    ddp = DDP(module, device_ids=device_ids, process_group=group, bucket_cap_mb=bucket_cap_bytes / 2**20,
              **no_buffer_sync)
    if log_comm:
        ddp.register_comm_hook(_HookState(ctx, group), logged_allreduce_hook)
    return ddp


def module_device(module: nn.Module) -> torch.device:
    """The device of the module's first parameter (CPU for a module without parameters)."""
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


# ------------------------------------------------------------------------------------------------------
# builders for run_experiments, and the rank function notebooks launch
# ------------------------------------------------------------------------------------------------------
def build(variant: str, module: nn.Module, ctx, *, lr: float = 1e-3, group=None,
          bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, log_comm: bool = True):
    """Wrap ``module`` as ``variant`` (one of :data:`VARIANTS`) and build the lab's AdamW over its
    parameters. Returns (wrapped, optimizer). Raises ValueError for an unknown variant."""
    from labkit.checks import check_choice

    check_choice("variant", variant, VARIANTS)
    if variant == "naive":
        wrapped = DataParallelNaive(module, ctx, group)
    elif variant == "bucket":
        wrapped = DataParallelBucket(module, ctx, group, bucket_cap_bytes)
    else:
        wrapped = torch_ddp(module, ctx, group, bucket_cap_bytes, log_comm)
    return wrapped, make_optimizer(module.parameters(), lr)


#: variant -> builder ``fn(module, ctx, **options) -> (wrapped, optimizer)`` for run_experiments
WRAPPERS = {v: functools.partial(build, v) for v in VARIANTS}


def run_rank(ctx, runs: list[dict] | None = None, **kwargs) -> list[dict]:
    """Rank function: :func:`labkit.parallel.harness.run_experiments` over the data-parallel variants.

    ``runs`` defaults to one run of each of :data:`VARIANTS`; keyword arguments are run_experiments'
    (model, steps, global_batch_size, seq_len, n_microbatches, lr, seed, bucket_cap_bytes, ...).
    Example: ``launch(labkit.parallel.data.run_rank, 2, runs=[{"variant": "bucket"}], steps=3)``.
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
    return float(_unwrap_module(model).w.grad)


def _unwrap_module(model):
    return getattr(model, "module", model)


def accumulation_demo_rank(ctx, variants=VARIANTS) -> dict:
    """Rank function: :func:`accumulation_demo` for each variant, syncing on the last micro-batch (correct)
    and on the first (the bug). Returns {variant: {"correct": grad, "wrong": grad}} for this rank."""
    return {v: {"correct": accumulation_demo(ctx, v), "wrong": accumulation_demo(ctx, v, 0)} for v in variants}


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


def check_batch(world_size: int, global_batch_size, n_microbatches=1, *, dp_name: str = "dp") -> int:
    """Validate a data-parallel batch split before any launch; returns the local batch size.

    ``world_size`` (= dp) ranks each take ``global_batch_size / dp`` sequences and cut them into
    ``n_microbatches`` equal micro-batches. Raises ValueError naming the value and valid choices when dp does
    not divide global_batch_size or n_microbatches does not divide the local batch."""
    n = positive_int("world_size", world_size)
    gbs = positive_int("global_batch_size", global_batch_size)
    m = positive_int("n_microbatches", n_microbatches)
    unit = n * m
    near = " or ".join(map(str, sorted({max(unit, gbs // unit * unit), -(-gbs // unit) * unit})))
    hint = (f"or choose global_batch_size as a multiple of {dp_name} x n_microbatches = {n} x {m} = {unit} "
            f"(e.g. {near})" if m > 1 else f"or choose global_batch_size as a multiple of {dp_name}={n} (e.g. {near})")
    check_divides(dp_name, n, "global_batch_size", gbs, hint=hint)
    local = gbs // n
    check_divides("n_microbatches", m, "local_batch_size", local,
                  hint=f"local_batch_size = global_batch_size / {dp_name} = {gbs} / {n}; {hint}")
    return local


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
    Returns {"runs": [...], "demo": {...}, "scaling": [...]}; :func:`summarize` and
    :func:`exposure_table` accept the LaunchResult directly."""
    out = {"runs": run_rank(ctx, runs, **kwargs), "demo": accumulation_demo_rank(ctx)}
    same = {k: kwargs[k] for k in ("model", "seq_len", "seed") if k in kwargs}  # the training runs' own values
    out["scaling"] = (scaling_rank(ctx, scaling_batch_sizes, steps=scaling_steps, **same)
                      if scaling_batch_sizes else [])
    return out
