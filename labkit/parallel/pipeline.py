"""Pipeline parallelism on real ranks: the schedules of :mod:`labkit.theory.simulate`, executed action by action,
every action recorded in the rank's timeline.

Two implementations side by side, run by one rank function (:func:`pipeline_rank`):

* ``impl="labkit"`` — hand-written: each rank walks ``schedule.actions[rank]`` (the very lists the simulator
  runs), receives activations / gradients with ``irecv`` posted at the start of the step, sends with
  ``isend``, and waits on *every* work handle (recvs before use, sends at the end of the step; a step that
  ends with a handle not waited on raises). Compute is ``"fixed"`` (each op sleeps its configured F/B/W
  duration: a stand-in that lets a schedule's shape be studied with more ranks than cores; sleeping, not
  spinning, so ranks sharing a core do not slow each other) or ``"real"`` (the lab's model cut into
  ``pp * v`` stages). In ZB-H1 the backward is split: B computes input gradients and queues each
  ``nn.Linear``'s weight-gradient matmul, W runs the queue (Qi et al. 2023, Sec. 2).
* ``impl="torch"`` — ``torch.distributed.pipelining`` (PipelineStage + ScheduleGPipe / Schedule1F1B /
  ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble with one stage per rank for ZB-H1) on the same
  stage modules, its ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk`` timed
  into the timeline (so its action order is observed, not assumed).

Timeline events (labkit.runtime.timeline columns): ``F``/``B``/``W`` (kind compute), ``recv`` (kind comm: the wait
on an irecv handle — mostly waiting for the producing stage), ``send`` (kind comm: posting an isend),
``idle`` (kind idle: gaps between events inside a step), ``optim`` and ``tied_grad`` (after the flush).
Tags: step (timed steps from 0; warm-up steps are dropped), microbatch, stage (global stage index).

Measured bubble (what :func:`bubble_from_timeline` computes per step, fraction of total time)::

    bubble_fraction = 1 - sum_r busy_r / (p * makespan)

busy_r = time rank r spends in F/B/W; makespan = first F start to last F/B/W end over all ranks.

Use :func:`run_pipeline` (one configuration) or :func:`run_pipelines` (several in one launch); both check
their arguments before anything starts (ValueError naming the fix). The hand-written runner is gloo-only:
it posts every ``irecv`` of a step up front, which gloo matches by tag and completes asynchronously but
NCCL's in-order p2p streams would serialise into a deadlock; on NCCL use ``impl="torch"``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.checks import check_choice, check_divides, positive_float, positive_int
from labkit.runtime import timeline as tl
from labkit.theory import simulate as sim
from labkit.theory.simulate import Action, OpCosts, Schedule

COMPUTE_MODES = ("fixed", "real")
IMPLS = ("labkit", "torch")
COMPUTE_OPS = ("F", "B", "W")
#: default stand-in op costs (seconds) for fixed compute: long enough that scheduling noise is small
DEFAULT_FIXED_COSTS = OpCosts(f=0.02, b=0.02, w=0.02)


# ------------------------------------------------------------------------------------------------------
# validation (before any launch)
# ------------------------------------------------------------------------------------------------------
def stage_layer_counts(n_layers: int, n_stages: int, layers_per_stage: Sequence[int] | None = None) -> tuple[int, ...]:
    """Layers held by each global stage: equal (``n_layers / n_stages`` each) or ``layers_per_stage``.

    Raises ValueError when ``n_stages`` (= pp*v) does not divide ``n_layers`` and no explicit split is given,
    or when the explicit split has the wrong length, a stage with no layer, or the wrong total.
    """
    n_layers = positive_int("n_layers", n_layers)
    n_stages = positive_int("pp*v", n_stages)
    if layers_per_stage is None:
        check_divides("pp*v", n_stages, "n_layers", n_layers,
                      hint="or give an uneven split with layers_per_stage=(...) (one count per stage)")
        return (n_layers // n_stages,) * n_stages
    counts = tuple(positive_int(f"layers_per_stage[{i}]", c) for i, c in enumerate(layers_per_stage))
    if len(counts) != n_stages:
        raise ValueError(f"layers_per_stage has {len(counts)} entries but pp*v={n_stages} stages need one each")
    if sum(counts) != n_layers:
        raise ValueError(f"layers_per_stage={counts} sums to {sum(counts)}, not n_layers={n_layers}")
    return counts


def check_job(job: dict, pp: int) -> dict:
    """Validate one pipeline configuration and fill its defaults; returns the completed job dict.

    Checks, each raising ValueError that names the fix: schedule name, pp >= 2, v, n_microbatches enough
    for the schedule (and a multiple of pp for interleaved), compute mode and impl, costs (fixed), the model
    spec, ``global_batch_size`` divisible by ``n_microbatches`` (equal micro-batches: an uneven split such as
    8 over 3 gives (3, 3, 2) and the averaged loss no longer matches), ``n_layers`` divisible by pp*v unless
    ``layers_per_stage`` is given, ``seq_len`` within the model's ``max_seq_len``, and the torch impl's limits.
    """
    job = dict(job)
    known = {"schedule", "n_microbatches", "v", "compute", "impl", "costs", "spec", "global_batch_size", "seq_len",
             "layers_per_stage", "steps", "warmup_steps", "lr", "seed", "data_seed", "fixed_nbytes", "return_grads",
             "label"}
    unknown = sorted(set(job) - known)
    if unknown:
        raise ValueError(f"unknown pipeline option(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
    job.setdefault("schedule", "1f1b")
    job.setdefault("v", 2 if job["schedule"] == "interleaved" else 1)
    job.setdefault("n_microbatches", 2 * pp)
    job.setdefault("compute", "fixed")
    job.setdefault("impl", "labkit")
    name, p, m, v = sim.check_schedule_args(job["schedule"], pp, job["n_microbatches"], job["v"])
    job.update(schedule=name, n_microbatches=m, v=v)
    check_choice("compute", job["compute"], COMPUTE_MODES)
    check_choice("impl", job["impl"], IMPLS)
    job["steps"] = positive_int("steps", job.get("steps", 2))
    job["warmup_steps"] = positive_int("warmup_steps", job.get("warmup_steps", 1), minimum=0)
    job.setdefault("return_grads", False)
    vs = f" v={v}" if v > 1 else ""
    job.setdefault("label", f"{job['impl']} {name} pp={p} m={m}{vs} ({job['compute']})")
    if job["impl"] == "torch" and job["compute"] != "real":
        raise ValueError("impl='torch' runs the model (torch.distributed.pipelining drives real stage modules); "
                         "use compute='real' with impl='torch', or impl='labkit' for fixed compute")
    if job["compute"] == "fixed":
        costs = job.get("costs") or DEFAULT_FIXED_COSTS
        if not isinstance(costs, OpCosts):
            raise ValueError(f"costs={costs!r} must be a labkit.theory.simulate.OpCosts (seconds per op)")
        costs.resolve(p * v)  # raises for bad values / wrong per-stage length
        job["costs"] = costs
        job["fixed_nbytes"] = positive_int("fixed_nbytes", job.get("fixed_nbytes", 4096), minimum=4)
        return job
    from labkit.theory.spec import ModelSpec, get_spec

    spec = job.get("spec") or "lab-tiny-llama"
    spec = get_spec(spec) if isinstance(spec, str) else spec
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"spec={spec!r} must be a ModelSpec or a preset name")
    if spec.is_moe:
        raise ValueError(f"spec {spec.name!r} is a mixture-of-experts model; the pipeline runner splits dense "
                         "models (use a dense preset such as 'lab-tiny-llama')")
    job["spec"] = spec
    job["layers_per_stage"] = stage_layer_counts(spec.n_layers, p * v, job.get("layers_per_stage"))
    gbs = positive_int("global_batch_size", job.get("global_batch_size") or 2 * m)
    check_divides("n_microbatches", m, "global_batch_size", gbs,
                  hint=f"micro-batches must be equal, e.g. global_batch_size={m * max(1, round(gbs / m))}")
    job["global_batch_size"] = gbs
    job["seq_len"] = positive_int("seq_len", job.get("seq_len", 32))
    if job["seq_len"] > spec.max_seq_len:
        raise ValueError(f"seq_len={job['seq_len']} exceeds the model's max_seq_len={spec.max_seq_len}")
    job["lr"] = positive_float("lr", job.get("lr", 1e-3), allow_zero=True)
    job["seed"] = int(job.get("seed", 0))
    job["data_seed"] = int(job.get("data_seed", 0))
    return job


def _min_chapter_microbatches(p: int) -> int:
    """The fewest micro-batches every schedule of chapter 06 runs with on ``p`` ranks (a multiple of p)."""
    need = max(sim.min_microbatches(name, p) for name in sim.SCHEDULES)
    return -(-need // p) * p


def _microbatch_problem(p: int, m: int, gbs: int) -> str | None:
    """Why chapter 06 cannot run ``m`` micro-batches of ``gbs`` sequences on ``p`` ranks, or None."""
    for name in sim.SCHEDULES:
        try:
            sim.check_schedule_args(name, p, m, 2 if name == "interleaved" else 1)
        except ValueError:
            return (f"does not suit every schedule of this chapter on pp={p}: 1F1B needs n_microbatches >= "
                    f"{max(sim.min_microbatches(n, p) for n in sim.SCHEDULES)} and the interleaved schedule a "
                    f"multiple of pp={p} (Narayanan et al. 2021)")
    if gbs % m:
        return f"does not divide global_batch_size={gbs} (micro-batches must be equal)"
    return None


def chapter_microbatches(pp: int, global_batch_size: int) -> list[int]:
    """The n_microbatches chapter 06 accepts for ``global_batch_size`` on ``pp`` ranks: divisors of the batch
    that every schedule runs with (>= :func:`labkit.theory.simulate.min_microbatches`, a multiple of pp for the
    interleaved schedule). Empty when none. Raises ValueError for pp < 2 or a non-positive batch."""
    pp = positive_int("pp", pp, minimum=2)
    gbs = positive_int("global_batch_size", global_batch_size)
    return [d for d in range(1, gbs + 1) if gbs % d == 0 and _microbatch_problem(pp, d, gbs) is None]


def check_chapter(*, world_size, n_microbatches=None, op_ms=20.0, sweep=(1, 2, 4), steps=2,
                  spec_name: str = "lab-tiny-llama", vocab_size=8192, global_batch_size=None, seq_len=32,
                  bubble_tol=0.05, timeout_s=180.0) -> dict:
    """Chapter 06's parameters, all checked before any launch (the chapter's first cell after its parameters).

    Resolves the defaults (``n_microbatches`` None -> 2·pp, ``global_batch_size`` None -> 2·m) and checks,
    each with a ValueError naming the value and the fix: world_size = pp >= 2; m enough for every schedule and
    a multiple of pp (interleaved); every sweep factor k a positive integer (m = k·pp); op_ms, bubble_tol
    (below 1) and timeout_s positive; steps >= 1; a dense, known ``spec_name`` with ``vocab_size`` and
    n_layers = 2·pp (one layer per interleaved stage); m dividing global_batch_size; seq_len within
    max_seq_len. Every job the chapter launches (fixed and real compute, ours and torch's) passes
    :func:`check_job`.

    Returns ``{"pp", "n_microbatches", "global_batch_size", "sweep_microbatches", "costs" (OpCosts, s),
    "spec" (the real-compute ModelSpec)}``.
    """
    from labkit.chapters.common import check_fits_in_memory, check_world_size
    from labkit.theory.spec import get_spec

    p = check_world_size("06", world_size, why="a pipeline needs at least two stages, one per rank")
    m = positive_int("n_microbatches", n_microbatches) if n_microbatches is not None else 2 * p
    gbs = positive_int("global_batch_size", global_batch_size) if global_batch_size is not None else 2 * m
    problem = _microbatch_problem(p, m, gbs)
    if problem:
        valid = chapter_microbatches(p, gbs)
        fix = (f"n_microbatches that pass every rule with global_batch_size={gbs} on pp={p}: "
               f"{', '.join(map(str, valid))}" if valid else
               f"no n_microbatches passes every rule with global_batch_size={gbs} on pp={p}; use a "
               f"global_batch_size that is a multiple of {_min_chapter_microbatches(p)}, e.g. "
               f"global_batch_size={2 * _min_chapter_microbatches(p)}")
        raise ValueError(f"n_microbatches={m} {problem}; {fix}")
    ks = [positive_int(f"sweep[{i}]", k) for i, k in enumerate(sweep)]
    if not ks:
        raise ValueError("sweep=[] is empty: give at least one factor k (m = k * world_size), e.g. sweep=[1, 2]")
    op_s = positive_float("op_ms", op_ms) / 1e3
    tol = positive_float("bubble_tol", bubble_tol)
    if tol >= 1:
        raise ValueError(f"bubble_tol={bubble_tol} must be below 1 (a bubble fraction is between 0 and 1); "
                         "e.g. bubble_tol=0.05")
    positive_float("timeout_s", timeout_s)
    steps = positive_int("steps", steps)
    spec = get_spec(spec_name).replace(n_layers=2 * p, vocab_size=positive_int("vocab_size", vocab_size))
    costs = OpCosts(f=op_s, b=op_s, w=op_s)
    ms = sorted({k * p for k in ks} | {m})
    jobs = [dict(schedule=s, n_microbatches=mm, steps=steps, costs=costs) for mm in ms for s in ("gpipe", "1f1b")]
    jobs += [dict(schedule="interleaved", n_microbatches=m, v=2, steps=steps,
                  costs=OpCosts(costs.f / 2, costs.b / 2, costs.w / 2)),
             dict(schedule="zb-h1", n_microbatches=m, costs=costs, steps=steps)]
    real = dict(compute="real", spec=spec, global_batch_size=gbs, seq_len=seq_len, steps=steps, n_microbatches=m)
    jobs += [dict(real, schedule=s) for s in sim.SCHEDULES]
    jobs += [dict(real, schedule=s, impl="torch") for s in ("gpipe", "1f1b", "interleaved")]
    for job in jobs:
        check_job(job, p)
    check_fits_in_memory(spec, p, copies=2, what="chapter 06")
    return {"pp": p, "n_microbatches": m, "global_batch_size": gbs, "sweep_microbatches": ms, "costs": costs,
            "spec": spec}


# ------------------------------------------------------------------------------------------------------
# torch.distributed.pipelining's own action order (an independent check of ours)
# ------------------------------------------------------------------------------------------------------
def torch_pipeline_order(name: str, p: int, m: int, v: int = 1) -> tuple[tuple[Action, ...], ...] | None:
    """The compute actions torch.distributed.pipelining plans for schedule ``name``, in our notation
    (``B`` for torch's full backward ``B`` and for its input backward ``I``; ``W`` for weight backward).

    Read from torch's schedule IR without a process group: ``ScheduleGPipe`` / ``Schedule1F1B``
    ``_get_pipeline_order`` and ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble`` (one stage
    per rank = ZB-H1, which torch calls ZB1P) ``_calculate_single_rank_operations``. These are private
    torch APIs: returns None when the installed torch lacks them. Note (torch 2.13): Schedule1F1B's IR
    numbers the last rank's forwards from 1 instead of 0 (an IR-only off-by-one; its runtime order is
    right, which the torch-native runs observe).
    Raises ValueError as :func:`labkit.theory.simulate.check_schedule_args`.
    """
    sim.check_schedule_args(name, p, m, v)
    try:
        from torch.distributed.pipelining import schedules as S

        def convert(seq) -> tuple[Action, ...]:
            out = []
            for a in seq:
                if a is None:
                    continue
                t = getattr(a.computation_type, "value", str(a.computation_type))
                if t in ("F", "B", "I", "W"):
                    out.append(Action("B" if t == "I" else t, int(a.microbatch_index), int(a.stage_index)))
            return tuple(out)

        if name in ("gpipe", "1f1b"):
            cls = S.ScheduleGPipe if name == "gpipe" else S.Schedule1F1B
            order = cls._get_pipeline_order(types.SimpleNamespace(_num_stages=p, _n_microbatches=m))
            return tuple(convert(order[r]) for r in range(p))
        rounds = max(1, m // p)
        if m % rounds:
            return None
        ns = types.SimpleNamespace(n_local_stages=v, microbatches_per_round=m // rounds, pp_group_size=p,
                                   _n_microbatches=m)
        cls = S.ScheduleInterleaved1F1B if name == "interleaved" else S.ScheduleInterleavedZeroBubble
        return tuple(convert(cls._calculate_single_rank_operations(ns, r)) for r in range(p))
    except (ImportError, AttributeError, TypeError):
        return None


# ------------------------------------------------------------------------------------------------------
# stage modules
# ------------------------------------------------------------------------------------------------------
class StageModule(nn.Module):
    """Global stage ``stage`` of ``n_stages`` of a :class:`labkit.models.Transformer`, sharing its modules.

    Stage 0 embeds tokens [mb, T] (int64); every stage runs its blocks on hidden [mb, T, H]; the last stage
    applies the final norm and the output projection and returns logits [mb, T, V]. With tied embeddings
    the last stage holds its own copy of the embedding matrix (``head_weight``) whose gradient the runner
    sums with stage 0's after the flush (as Megatron-LM's embedding group all-reduce does), so both copies
    stay equal.
    """

    def __init__(self, model: nn.Module, stage: int, n_stages: int, layer_range: tuple[int, int]):
        super().__init__()
        self.stage, self.n_stages = stage, n_stages
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.dropout = model.spec.dropout
        self.embed = model.embed if self.is_first else None
        self.pos_embed = model.pos_embed if self.is_first else None
        self.layers = nn.ModuleList(model.layers[layer_range[0]:layer_range[1]])
        self.norm = model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.head_weight = None
        if self.is_last and model.lm_head is None:
            if self.is_first:
                raise ValueError("a single-stage pipeline cannot hold tied embeddings twice; use pp >= 2")
            self.head_weight = nn.Parameter(model.embed.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            h = self.embed(x)
            if self.pos_embed is not None:
                h = h + self.pos_embed(torch.arange(x.shape[1], device=x.device))
            x = F.dropout(h, self.dropout, self.training)
        for layer in self.layers:
            x = layer(x)
        if self.is_last:
            x = self.norm(x)
            x = self.lm_head(x) if self.lm_head is not None else x @ self.head_weight.t()
        return x


def build_stages(spec, stages: Sequence[int], layers_per_stage: Sequence[int], *, seed: int = 0,
                 device: torch.device | str = "cpu") -> tuple[nn.Module, dict[int, StageModule]]:
    """Build the full model from ``(spec, seed)`` (identical weights on every rank and in the reference)
    and cut out the global ``stages`` this rank holds. Returns ``(model, {stage: StageModule})``; modules
    of other stages stay in ``model`` but receive no gradient."""
    from labkit.models import build_model

    model = build_model(spec, seed=seed, device=device)
    bounds = [0]
    for c in layers_per_stage:
        bounds.append(bounds[-1] + c)
    n = len(layers_per_stage)
    return model, {s: StageModule(model, s, n, (bounds[s], bounds[s + 1])).to(device) for s in stages}


# ------------------------------------------------------------------------------------------------------
# split backward (ZB-H1): input gradients now, weight gradients later
# ------------------------------------------------------------------------------------------------------
class WeightGradStore:
    """Queues of deferred weight-gradient matmuls, keyed by (stage, microbatch) — filled during B, run by W."""

    def __init__(self):
        self.key: tuple[int, int] | None = None
        self.queues: dict[tuple[int, int], list] = {}

    def put(self, fn) -> None:
        self.queues.setdefault(self.key, []).append(fn)

    def run(self, key: tuple[int, int]) -> int:
        fns = self.queues.pop(key, [])
        for fn in fns:
            fn()
        return len(fns)


class _DeferredLinear(torch.autograd.Function):
    """y = x W^T + b whose backward returns dL/dx at once and queues dL/dW = g^T x, dL/db = sum g."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x)
        # the parameters themselves, not saved copies: W assigns their .grad (saved_tensors_hooks may hand
        # back another tensor object for a saved parameter)
        ctx.weight, ctx.bias, ctx.store = weight, bias, store
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        gx = g @ weight if ctx.needs_input_grad[0] else None

        def weight_grad(g=g, x=x, weight=weight, bias=bias):
            g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
            gw = g2.t() @ x2
            weight.grad = gw if weight.grad is None else weight.grad + gw
            if bias is not None:
                gb = g2.sum(0)
                bias.grad = gb if bias.grad is None else bias.grad + gb

        ctx.store.put(weight_grad)
        return gx, None, None, None


def defer_weight_grads(module: nn.Module, store: WeightGradStore) -> int:
    """Make every nn.Linear inside ``module`` queue its weight gradient into ``store`` instead of computing
    it during backward. Returns the number of linears changed."""
    n = 0
    for lin in module.modules():
        if isinstance(lin, nn.Linear):
            def fwd(self, x, _store=store):
                return _DeferredLinear.apply(x, self.weight, self.bias, _store)

            lin.forward = types.MethodType(fwd, lin)
            n += 1
    return n


# ------------------------------------------------------------------------------------------------------
# p2p with every handle waited on
# ------------------------------------------------------------------------------------------------------
class P2P:
    """isend / irecv that remember every work handle. ``drain()`` waits on all sends; ``check()`` raises
    RuntimeError when a handle was never waited on (gloo can hang when only some handles of a batch are
    waited on, so the runner refuses to finish a step with one outstanding)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.sends: list[tuple] = []
        self.created = 0
        self.waited = 0

    def isend(self, tensor: torch.Tensor, dst: int, tag: int, **tags) -> None:
        t0 = tl.now_ns()
        work = dist.isend(tensor, dst=dst, tag=tag)
        self.created += 1
        self.sends.append((work, tensor))
        self.ctx.timeline.add("send", "comm", t0, tl.now_ns(), nbytes=tensor.numel() * tensor.element_size(), **tags)

    def irecv(self, buf: torch.Tensor, src: int, tag: int):
        self.created += 1
        return dist.irecv(buf, src=src, tag=tag)

    def wait(self, work, buf: torch.Tensor, **tags) -> None:
        t0 = tl.now_ns()
        work.wait()
        self.waited += 1
        self.ctx.timeline.add("recv", "comm", t0, tl.now_ns(), nbytes=buf.numel() * buf.element_size(), **tags)

    def drain(self) -> None:
        for work, _ in self.sends:
            work.wait()
            self.waited += 1
        self.sends.clear()

    def check(self) -> None:
        if self.created != self.waited:
            raise RuntimeError(f"rank {self.ctx.rank}: {self.created - self.waited} p2p work handle(s) were never "
                               "waited on; every isend/irecv handle must be waited on")


def _tag(kind: int, stage: int, microbatch: int, m: int) -> int:
    """p2p tag for the activation (kind 0) entering ``stage`` or the gradient (kind 1) leaving it."""
    return (2 * stage + kind) * m + microbatch


# ------------------------------------------------------------------------------------------------------
# saved-activation accounting
# ------------------------------------------------------------------------------------------------------
class _SavedBytes:
    """saved_tensors_hooks that sum the bytes of distinct non-parameter storages autograd saves."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}
        self.seen: set[int] = set()
        self.nbytes = 0

    def pack(self, t):
        try:
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr not in self.param_ptrs and ptr not in self.seen:
                self.seen.add(ptr)
                self.nbytes += st.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    @staticmethod
    def unpack(t):
        return t


# ------------------------------------------------------------------------------------------------------
# the rank function
# ------------------------------------------------------------------------------------------------------
def pipeline_rank(ctx, jobs: Sequence[dict]) -> list[dict]:
    """Rank function: run each (already validated, see :func:`check_job`) job in turn; ``launch`` it with
    ``world_size = pp``. Returns one dict per job: ``events`` (this rank's timeline events of the job),
    ``step_s`` (wall time of each timed step on this rank), ``losses`` (last stage's rank, real compute),
    ``peak_inflight`` (most (stage, micro-batch) activation sets held at once), ``peak_saved_bytes``
    (real compute: autograd's saved tensors of those sets, excluding parameters; for ZB-H1 they are
    counted until W, an upper bound, since B frees the graph and only the queued matmuls' inputs stay), ``handles``
    (p2p handles created / waited), ``order`` (the compute actions as executed), ``grads`` (when asked)."""
    out = []
    for job in jobs:
        start = len(ctx.timeline.events)
        if job["impl"] == "torch":
            res = _run_torch(ctx, job, start)
        else:
            res = _run_labkit(ctx, job, start)
        res["events"] = ctx.timeline.events[start:]
        del ctx.timeline.events[start:]
        res["offset_ns"] = ctx.timeline.offset_ns
        out.append(res)
        ctx.barrier()
    return out


def _fill_idle(ctx, start_ns: int, end_ns: int, first_event: int, step: int) -> None:
    """Record the gaps between this rank's events of one step as ``idle`` events."""
    spans = sorted((e[3], e[4]) for e in ctx.timeline.events[first_event:])
    t = start_ns
    for s, e in spans:
        if s > t:
            ctx.timeline.add("idle", "idle", t, s, step=step)
        t = max(t, e)
    if end_ns > t:
        ctx.timeline.add("idle", "idle", t, end_ns, step=step)


def _schedule_for(job: dict, pp: int) -> Schedule:
    return sim.make_schedule(job["schedule"], pp, job["n_microbatches"], job["v"])


def _run_labkit(ctx, job: dict, job_start: int) -> dict:
    sched = _schedule_for(job, ctx.world_size)
    real = job["compute"] == "real"
    rank, m, n_stages = ctx.rank, sched.m, sched.n_stages
    my_actions = sched.actions[rank]
    last_op = sched.last_backward_op()
    dev = ctx.device
    store = WeightGradStore()
    # ---- model / stand-in setup
    if real:
        from labkit.models import SyntheticLM, lm_loss, make_optimizer, shard

        spec = job["spec"]
        model, stages = build_stages(spec, sched.stages_of(rank), job["layers_per_stage"], seed=job["seed"], device=dev)
        params = [p for s in stages.values() for p in s.parameters()]
        uniq = list({id(p): p for p in params}.values())
        if sched.split_backward:
            for s in stages.values():
                defer_weight_grads(s, store)
        opt = make_optimizer(uniq, job["lr"]) if job["lr"] > 0 else None
        data = SyntheticLM(spec.vocab_size, job["seq_len"], job["data_seed"])
        mb_size = job["global_batch_size"] // m
        act_shape = (mb_size, job["seq_len"], spec.hidden_size)
        act_dtype = next(model.parameters()).dtype
    else:
        dur = job["costs"].op_seconds(sched)
        act_shape, act_dtype = (job["fixed_nbytes"] // 4,), torch.float32
    p2p = P2P(ctx)
    step_s, losses, order = [], [], []
    peak_inflight = peak_bytes = 0
    total_steps = job["warmup_steps"] + job["steps"]
    for it in range(total_steps):
        step = it - job["warmup_steps"]
        ctx.barrier()
        if step == 0:  # drop the warm-up steps' events
            del ctx.timeline.events[job_start:]
        first_event = len(ctx.timeline.events)
        t_start = tl.now_ns()
        tags = {"step": max(step, -1)}
        # post every receive of the step up front: a send never waits for the receiver to get there
        recvs: dict[tuple[str, int, int], tuple] = {}
        for a in my_actions:
            if a.op == "F" and a.stage > 0:
                buf = torch.empty(act_shape, dtype=act_dtype, device=dev)
                recvs[("F", a.stage, a.microbatch)] = (p2p.irecv(buf, sched.rank_of(a.stage - 1),
                                                                 _tag(0, a.stage, a.microbatch, m)), buf)
            elif a.op == "B" and a.stage < n_stages - 1:
                buf = torch.empty(act_shape, dtype=act_dtype, device=dev)
                recvs[("B", a.stage, a.microbatch)] = (p2p.irecv(buf, sched.rank_of(a.stage + 1),
                                                                 _tag(1, a.stage + 1, a.microbatch, m)), buf)
        if not real:  # stand-in messages, made before the clock matters: value = who sent it
            msgs = {a: torch.full(act_shape, _code(a.stage, a.microbatch, 0.0 if a.op == "F" else 0.5))
                    for a in my_actions if a.op in ("F", "B")}
        if real:
            tokens, targets = data.batch(it, job["global_batch_size"])
            if opt is not None:
                opt.zero_grad(set_to_none=True)
            else:
                for p in uniq:
                    p.grad = None
        held: dict[tuple[int, int], tuple] = {}
        held_bytes: dict[tuple[int, int], int] = {}
        cur_bytes = 0
        step_loss = 0.0
        for a in my_actions:
            key = (a.stage, a.microbatch)
            t = dict(tags, microbatch=a.microbatch, stage=a.stage)
            if a.op == "F":
                if a.stage > 0:
                    work, buf = recvs.pop(("F", a.stage, a.microbatch))
                    p2p.wait(work, buf, **t)
                    if not real:
                        _expect(buf, a.stage - 1, a.microbatch, 0.0, rank)
                if real:
                    x = shard(tokens, a.microbatch, m) if a.stage == 0 else buf.requires_grad_(True)
                    counter = _SavedBytes(uniq)
                    with ctx.timer("F", "compute", **t):
                        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                            y = stages[a.stage](x)
                            if a.stage == n_stages - 1:
                                y = lm_loss(y, shard(targets, a.microbatch, m)) / m
                    held[key] = (x, y)
                    held_bytes[key] = counter.nbytes
                    cur_bytes += counter.nbytes
                    peak_bytes = max(peak_bytes, cur_bytes)
                    if a.stage == n_stages - 1:
                        step_loss += float(y.detach())
                    else:
                        p2p.isend(y.detach(), sched.rank_of(a.stage + 1), _tag(0, a.stage + 1, a.microbatch, m), **t)
                else:
                    with ctx.timer("F", "compute", **t):
                        time.sleep(dur[a])
                    held[key] = ()
                    if a.stage < n_stages - 1:
                        p2p.isend(msgs[a], sched.rank_of(a.stage + 1), _tag(0, a.stage + 1, a.microbatch, m), **t)
                peak_inflight = max(peak_inflight, len(held))
            elif a.op == "B":
                g = None
                if a.stage < n_stages - 1:
                    work, g = recvs.pop(("B", a.stage, a.microbatch))
                    p2p.wait(work, g, **t)
                    if not real:
                        _expect(g, a.stage + 1, a.microbatch, 0.5, rank)
                if real:
                    x, y = held[key]
                    store.key = key
                    with ctx.timer("B", "compute", **t):
                        torch.autograd.backward(y, grad_tensors=g)
                    if a.stage > 0:
                        p2p.isend(x.grad, sched.rank_of(a.stage - 1), _tag(1, a.stage, a.microbatch, m), **t)
                    held[key] = ()  # the graph is freed; split backward keeps only the queued W inputs
                else:
                    with ctx.timer("B", "compute", **t):
                        time.sleep(dur[a])
                    if a.stage > 0:
                        p2p.isend(msgs[a], sched.rank_of(a.stage - 1), _tag(1, a.stage, a.microbatch, m), **t)
            else:  # W
                with ctx.timer("W", "compute", **t):
                    if real:
                        store.run(key)
                    else:
                        time.sleep(dur[a])
            if a.op == last_op:
                held.pop(key, None)
                cur_bytes -= held_bytes.pop(key, 0)
            order.append(a)
        if held or recvs:
            raise RuntimeError(f"rank {rank}: step ended with activations held for {sorted(held)} or receives "
                               f"pending for {sorted(recvs)}; the schedule is incomplete")
        p2p.drain()
        p2p.check()
        if real:
            _sync_tied(ctx, sched, stages, p2p, tags, spec.tied_embeddings)
            if opt is not None:
                with ctx.timer("optim", "other", **tags):
                    opt.step()
            losses.append(step_loss if rank == sched.rank_of(n_stages - 1) else None)
        t_end = tl.now_ns()
        _fill_idle(ctx, t_start, t_end, first_event, tags["step"])
        step_s.append((t_end - t_start) / 1e9)
    res = {"step_s": step_s[job["warmup_steps"]:], "losses": losses[job["warmup_steps"]:] if real else [],
           "peak_inflight": peak_inflight, "peak_saved_bytes": peak_bytes if real else None,
           "handles": (p2p.created, p2p.waited), "order": order[-len(my_actions):], "rank": rank}
    if real and job.get("return_grads"):
        res["grads"] = _named_grads(model, stages)
    return res


def _code(stage: int, microbatch: int, kind: float) -> float:
    return stage * 1000.0 + microbatch + kind


def _expect(buf: torch.Tensor, stage: int, microbatch: int, kind: float, rank: int) -> None:
    want = _code(stage, microbatch, kind)
    if float(buf[0]) != want or float(buf[-1]) != want:
        raise RuntimeError(f"rank {rank}: received {float(buf[0])} but expected the message of stage {stage}, "
                           f"micro-batch {microbatch} ({want}): p2p messages crossed")


def _sync_tied(ctx, sched: Schedule, stages: dict, p2p: P2P, tags: dict, tied: bool) -> None:
    """Sum the gradients of the two copies of a tied embedding (stage 0's ``embed.weight`` and the last
    stage's ``head_weight``) between their two ranks, so both copies take the same update."""
    first, last = sched.rank_of(0), sched.rank_of(sched.n_stages - 1)
    if not tied or ctx.rank not in (first, last):
        return
    w = stages[0].embed.weight if ctx.rank == first else stages[sched.n_stages - 1].head_weight
    g = (w.grad if w.grad is not None else torch.zeros_like(w)).contiguous()
    other = last if ctx.rank == first else first
    buf = torch.empty_like(g)
    t0 = tl.now_ns()
    tag = 2 * sched.n_stages * sched.m + 1
    work = p2p.irecv(buf, other, tag)
    p2p.isend(g, other, tag, **tags)
    p2p.wait(work, buf, **tags)
    p2p.drain()
    p2p.check()
    w.grad = g + buf
    ctx.timeline.add("tied_grad", "comm", t0, tl.now_ns(), nbytes=g.numel() * g.element_size(), **tags)


def _named_grads(model: nn.Module, stages: dict) -> dict[str, torch.Tensor]:
    """Gradients of this rank's parameters under their names in the full model (``layers.3.attn.wq.weight``).
    A tied embedding's head copy is left out: after :func:`_sync_tied` it equals ``embed.weight``'s."""
    mine = {id(p) for s in stages.values() for p in s.parameters()}
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if id(p) in mine and p.grad is not None}


# ------------------------------------------------------------------------------------------------------
# torch.distributed.pipelining
# ------------------------------------------------------------------------------------------------------
_TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                    "zb-h1": "ScheduleInterleavedZeroBubble"}


def _run_torch(ctx, job: dict, job_start: int) -> dict:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as S

    from labkit.models import SyntheticLM, lm_loss, make_optimizer

    sched = _schedule_for(job, ctx.world_size)
    rank, m, n_stages = ctx.rank, sched.m, sched.n_stages
    spec = job["spec"]
    model, stages = build_stages(spec, sched.stages_of(rank), job["layers_per_stage"], seed=job["seed"],
                                 device=ctx.device)
    uniq = list({id(p): p for s in stages.values() for p in s.parameters()}.values())
    opt = make_optimizer(uniq, job["lr"]) if job["lr"] > 0 else None
    data = SyntheticLM(spec.vocab_size, job["seq_len"], job["data_seed"])
    mb = job["global_batch_size"] // m
    order: list[Action] = []
    cur_step = {"step": -1}
    pstages = []
    for s in sched.stages_of(rank):
        example = (torch.zeros(mb, job["seq_len"], dtype=torch.long, device=ctx.device) if s == 0 else
                   torch.zeros(mb, job["seq_len"], spec.hidden_size, device=ctx.device))
        st = PipelineStage(stages[s], s, n_stages, ctx.device, input_args=(example,))
        _instrument_torch_stage(ctx, st, s, order, cur_step)
        pstages.append(st)
    cls = getattr(S, _TORCH_SCHEDULES[sched.name])
    loss_fn = lambda out, tgt: lm_loss(out, tgt)  # noqa: E731 - torch averages over micro-batches (scale_grads)
    schedule = cls(pstages if sched.v > 1 or sched.name == "zb-h1" else pstages[0], n_microbatches=m, loss_fn=loss_fn)
    has_first = 0 in sched.stages_of(rank)
    has_last = n_stages - 1 in sched.stages_of(rank)
    step_s, losses = [], []
    total = job["warmup_steps"] + job["steps"]
    for it in range(total):
        step = it - job["warmup_steps"]
        cur_step["step"] = max(step, -1)
        ctx.barrier()
        if step == 0:
            del ctx.timeline.events[job_start:]
            order.clear()
        first_event = len(ctx.timeline.events)
        t_start = tl.now_ns()
        tokens, targets = data.batch(it, job["global_batch_size"])
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        else:
            for p in uniq:
                p.grad = None
        out_losses: list = []
        args = (tokens.to(ctx.device),) if has_first else ()
        kw = {"target": targets.to(ctx.device), "losses": out_losses} if has_last else {}
        schedule.step(*args, **kw)
        _sync_tied(ctx, sched, stages, P2P(ctx), {"step": cur_step["step"]}, spec.tied_embeddings)
        if opt is not None:
            with ctx.timer("optim", "other", step=cur_step["step"]):
                opt.step()
        losses.append(float(sum(float(x.detach()) for x in out_losses) / m) if has_last else None)
        t_end = tl.now_ns()
        _fill_idle(ctx, t_start, t_end, first_event, cur_step["step"])
        step_s.append((t_end - t_start) / 1e9)
    res = {"step_s": step_s[job["warmup_steps"]:], "losses": losses[job["warmup_steps"]:], "peak_inflight": None,
           "peak_saved_bytes": None, "handles": None, "order": list(order), "rank": rank}
    if job.get("return_grads"):
        res["grads"] = _named_grads(model, stages)
    return res


def _instrument_torch_stage(ctx, st, stage: int, order: list, cur_step: dict) -> None:
    """Time torch's per-micro-batch calls into the timeline and note the order they run in."""

    def wrap(name: str, attr: str, op: str):
        orig = getattr(st, attr, None)
        if orig is None:
            return

        def timed(*args, **kwargs):
            mbi = args[0] if args else kwargs.get(name)
            with ctx.timer(op, "compute", step=cur_step["step"], microbatch=int(mbi), stage=stage):
                result = orig(*args, **kwargs)
            order.append(Action(op, int(mbi), stage))
            return result

        setattr(st, attr, timed)

    wrap("fwd_chunk_id", "forward_one_chunk", "F")
    wrap("bwd_chunk_id", "backward_one_chunk", "B")
    wrap("bwd_chunk_id", "backward_weight_one_chunk", "W")


# ------------------------------------------------------------------------------------------------------
# the caller's side
# ------------------------------------------------------------------------------------------------------
def bubble_from_timeline(df: pd.DataFrame, p: int | None = None) -> pd.DataFrame:
    """Measured bubble per step from a timeline frame: ``step, makespan_s, busy_s (sum over ranks),
    bubble_fraction`` with ``bubble_fraction = 1 - busy / (p * makespan)`` over F/B/W events (fraction of
    total time). ``p`` defaults to the number of ranks in the frame."""
    comp = df[df["name"].isin(COMPUTE_OPS) & (df["step"] >= 0)]
    p = int(p or df["rank"].nunique())
    rows = []
    for step, g in comp.groupby("step"):
        makespan = (g["end_ns"].max() - g["start_ns"].min()) / 1e9
        busy = float(tl.busy_ns(g).sum()) / 1e9
        rows.append({"step": int(step), "makespan_s": makespan, "busy_s": busy,
                     "bubble_fraction": 1.0 - busy / (p * makespan) if makespan > 0 else 0.0})
    return pd.DataFrame(rows, columns=["step", "makespan_s", "busy_s", "bubble_fraction"])


def costs_from_timeline(df: pd.DataFrame, schedule: Schedule, p2p_s: float = 0.0) -> OpCosts:
    """Median measured duration of F, B (and W) per global stage, as :class:`OpCosts` for the simulator.
    Without a split backward the measured B is the full backward: it goes to ``b`` with ``w = 0``."""
    comp = df[df["name"].isin(COMPUTE_OPS) & (df["step"] >= 0)]
    med = (comp.assign(d=(comp["end_ns"] - comp["start_ns"]) / 1e9).groupby(["name", "stage"])["d"].median())

    def per(op):
        return tuple(float(med.get((op, s), 0.0)) for s in range(schedule.n_stages))

    return OpCosts(f=per("F"), b=per("B"), w=per("W") if schedule.split_backward else 0.0, p2p_s=p2p_s)


def hop_latency_from_timeline(df: pd.DataFrame, schedule: Schedule) -> float:
    """Median measured hop latency (s): from a producer op's end (F of stage s-1, or B of stage s+1) to
    the start of the op that consumes its output on the next rank, over the hops where the consumer was
    already waiting (its previous compute op had ended before the producer's). This lumps together
    posting the isend, the transfer, waking the receiver and the runner's bookkeeping: what the
    simulator's ``p2p_s`` stands for. 0.0 when no hop qualifies."""
    comp = df[df["name"].isin(COMPUTE_OPS) & (df["step"] >= 0)].sort_values("start_ns")
    ev = {(r.step, r.name, r.stage, r.microbatch): (r.start_ns, r.end_ns, r.rank) for r in comp.itertuples()}
    prev_end: dict[tuple, int] = {}
    last: dict[tuple[int, int], int] = {}
    for r in comp.itertuples():
        prev_end[(r.step, r.name, r.stage, r.microbatch)] = last.get((r.step, r.rank), -1)
        last[(r.step, r.rank)] = r.end_ns
    lat = []
    for (step, name, stage, mb), (start, _end, _rank) in ev.items():
        if name == "F" and stage > 0:
            prod = (step, "F", stage - 1, mb)
        elif name == "B" and stage < schedule.n_stages - 1:
            prod = (step, "B", stage + 1, mb)
        else:
            continue
        if prod in ev and prev_end[(step, name, stage, mb)] < ev[prod][1] <= start:
            lat.append((start - ev[prod][1]) / 1e9)
    return float(statistics.median(lat)) if lat else 0.0


@dataclass
class PipelineRun:
    """One configuration's measured run, with the predictions beside it.

    Attributes:
        job: the validated configuration; schedule: the :class:`~labkit.theory.simulate.Schedule` run.
        timeline: every rank's events (measured); steps: :func:`bubble_from_timeline` per timed step
            plus ``step_s`` (slowest rank's wall time of the step, measured).
        predicted: the simulator fed the configured costs (fixed) or the measured median op costs (real),
            no p2p latency.
        predicted_measured: the simulator fed the measured median op costs per stage and the measured hop
            latency (:func:`hop_latency_from_timeline`): what the runtime's overheads add.
        formula: the textbook bubble (fraction of total time) from :func:`labkit.theory.simulate.bubble_formula`.
        peak_inflight / peak_saved_bytes: per rank (measured); losses: per step (real compute);
        grads: parameter name -> gradient of the last step (when asked); order: per rank, actions executed.
    """

    job: dict
    schedule: Schedule
    timeline: pd.DataFrame
    steps: pd.DataFrame
    predicted: sim.SimResult
    predicted_measured: sim.SimResult
    formula: float
    peak_inflight: tuple
    peak_saved_bytes: tuple
    losses: list
    grads: dict
    order: tuple
    handles: tuple

    @property
    def bubble_measured(self) -> float:
        """Median measured bubble fraction over the timed steps."""
        return float(self.steps["bubble_fraction"].median())

    @property
    def bubble_measured_min(self) -> float:
        """Smallest measured bubble fraction over the timed steps: the least-disturbed step (other processes
        taking a core only ever add idle time)."""
        return float(self.steps["bubble_fraction"].min())

    @property
    def step_s(self) -> float:
        """Median measured step time (s), slowest rank."""
        return float(self.steps["step_s"].median())

    def title(self) -> str:
        j = self.job
        what = ("fixed compute: sleeping stand-in ops of configured F/B/W durations" if j["compute"] == "fixed"
                else f"real compute: {j['spec'].name}")
        return f"{j['label']} — measured ({what})"

    def summary(self) -> dict:
        """One row: configuration, measured bubble and step time beside simulator and formula (labelled)."""
        j = self.job
        return {"impl": j["impl"], "schedule": j["schedule"], "compute": j["compute"], "pp": self.schedule.p,
                "n_microbatches": self.schedule.m, "v": self.schedule.v,
                "bubble_measured": self.bubble_measured, "bubble_measured_min": self.bubble_measured_min,
                "bubble_simulated": self.predicted.bubble_fraction,
                "bubble_simulated_measured_costs": self.predicted_measured.bubble_fraction,
                "hop_latency_s_measured": self.predicted_measured.costs.p2p_s,
                "bubble_formula": self.formula, "step_s_measured": self.step_s,
                "makespan_s_measured": float(self.steps["makespan_s"].median()),
                "makespan_s_simulated": self.predicted.makespan_s,
                "peak_inflight_measured": max(self.peak_inflight) if self.peak_inflight[0] is not None else None,
                "peak_inflight_simulated": max(self.predicted.peak_inflight)}


def run_pipelines(jobs: Sequence[dict], pp: int, *, timeout_s: float = 120.0, backend: str = "gloo",
                  echo: bool = True) -> list[PipelineRun]:
    """Run several pipeline configurations in ONE launch of ``pp`` ranks (a launch costs seconds).

    Each job is a dict of :func:`run_pipeline`'s keyword arguments (``schedule``, ``n_microbatches``, ``v``,
    ``compute``, ``impl``, ``costs``, ``spec``, ``global_batch_size``, ``seq_len``, ``layers_per_stage``,
    ``steps``, ``warmup_steps``, ``lr``, ``seed``, ``data_seed``, ``fixed_nbytes``, ``return_grads``,
    ``label``). Every job is checked before the launch (ValueError naming the fix); ``timeout_s`` bounds the
    whole launch (a hang ends in :class:`labkit.runtime.launcher.LaunchTimeout` with every rank's stack).
    ``backend`` defaults to gloo: the hand-written runner is gloo-only (NCCL: ``impl="torch"`` jobs only).
    """
    from labkit.runtime.launcher import launch, resolve_backend

    pp = positive_int("pp", pp)
    if not jobs:
        raise ValueError("jobs is empty; give at least one pipeline configuration")
    checked = [check_job(j, pp) for j in jobs]
    if resolve_backend(backend, pp) == "nccl" and any(j["impl"] == "labkit" for j in checked):
        # NCCL matches p2p in issue order on one stream per peer pair, so posting every irecv up front
        # (safe on gloo, which matches by tag and completes asynchronously) would block the sends behind them
        raise ValueError("impl='labkit' runs on gloo only (it posts every irecv of a step up front, which "
                         "NCCL's in-order p2p would serialise into a deadlock); use backend='gloo' or "
                         "impl='torch' on NCCL")
    res = launch(pipeline_rank, pp, checked, timeout_s=timeout_s, backend=backend, echo=echo)
    return [_assemble(job, [r[i] for r in res], pp) for i, job in enumerate(checked)]


def run_pipeline(schedule: str = "1f1b", pp: int = 2, n_microbatches: int | None = None, v: int | None = None, *,
                 timeout_s: float = 120.0, backend: str = "gloo", echo: bool = True, **options) -> PipelineRun:
    """Run one pipeline configuration on ``pp`` ranks and return its :class:`PipelineRun`.

    Args:
        schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved"`` or ``"zb-h1"``.
        pp: ranks (>= 2). n_microbatches: micro-batches per step (default 2*pp). v: virtual stages per rank
            (interleaved only; default 2).
        compute: ``"fixed"`` (default; sleeping stand-ins with ``costs`` seconds per op, default 20 ms each)
            or ``"real"`` (the lab's model ``spec``, default ``"lab-tiny-llama"``).
        impl: ``"labkit"`` (default) or ``"torch"`` (torch.distributed.pipelining; real compute).
        global_batch_size, seq_len: real compute's batch (default 2 per micro-batch, 32 tokens).
        layers_per_stage: an uneven split (one count per global stage); default equal.
        steps / warmup_steps: timed and untimed steps (default 2 / 1); lr: AdamW step size (0 = no update).
        return_grads: also return the last step's gradients by parameter name.

    Raises:
        ValueError: any bad argument, before launching (see :func:`check_job`), or ``impl="labkit"`` on NCCL.
        labkit.runtime.launcher.RankFailed / LaunchTimeout: a rank failed or the run hung past ``timeout_s``.
    """
    job = {"schedule": schedule, **options}
    if n_microbatches is not None:
        job["n_microbatches"] = n_microbatches
    if v is not None:
        job["v"] = v
    return run_pipelines([job], pp, timeout_s=timeout_s, backend=backend, echo=echo)[0]


def _assemble(job: dict, per_rank: list[dict], pp: int) -> PipelineRun:
    sched = _schedule_for(job, pp)
    frames = []
    for r, out in enumerate(per_rank):
        t = tl.Timeline(r, out.get("offset_ns", 0))
        t.events = out["events"]
        frames.append(t.to_frame())
    df = tl.concat(frames)
    steps = bubble_from_timeline(df, pp)
    step_wall = [max(vals) for vals in zip(*(o["step_s"] for o in per_rank))]
    steps["step_s"] = step_wall[: len(steps)] if len(step_wall) >= len(steps) else math.nan
    measured_costs = costs_from_timeline(df, sched, hop_latency_from_timeline(df, sched))
    costs = job["costs"] if job["compute"] == "fixed" else dataclasses.replace(measured_costs, p2p_s=0.0)
    predicted = sim.simulate(sched, costs)
    predicted_measured = sim.simulate(sched, measured_costs)
    uniform = job["compute"] == "fixed" and all(isinstance(x, (int, float)) for x in (costs.f, costs.b, costs.w))
    kw = {"f": costs.f, "b": costs.b, "w": costs.w} if uniform else {}
    formula = sim.bubble_formula(sched.name, sched.p, sched.m, sched.v, **kw)
    last_rank = sched.rank_of(sched.n_stages - 1)
    grads: dict = {}
    for o in per_rank:
        for k, g in (o.get("grads") or {}).items():
            grads.setdefault(k, g)
    return PipelineRun(
        job=job, schedule=sched, timeline=df, steps=steps, predicted=predicted, predicted_measured=predicted_measured,
        formula=formula,
        peak_inflight=tuple(o["peak_inflight"] for o in per_rank),
        peak_saved_bytes=tuple(o["peak_saved_bytes"] for o in per_rank),
        losses=list(per_rank[last_rank]["losses"]), grads=grads,
        order=tuple(tuple(o["order"]) for o in per_rank), handles=tuple(o["handles"] for o in per_rank),
    )


# ------------------------------------------------------------------------------------------------------
# choosing stage boundaries from measured times
# ------------------------------------------------------------------------------------------------------
def measure_layer_costs(spec, micro_batch_size: int = 2, seq_len: int = 32, *, repeats: int = 5,
                        seed: int = 0, threads: int = 1) -> list[float]:
    """Measured forward + backward seconds of each layer for one micro-batch, in this process (the minimum
    of ``repeats`` after one warm-up call: other processes on the cores only ever add time), with the
    embedding's time added to the first layer and the final norm + output head (and loss) added to the
    last: the per-layer costs :func:`labkit.theory.simulate.balance_layers` splits.

    Runs on ``threads`` torch threads (default 1, what a rank gets when ranks share the cores; restored
    afterwards). ``spec``: a ModelSpec or preset name. Raises ValueError for bad sizes.
    """
    from labkit.models import build_model
    from labkit.theory.spec import get_spec

    spec = get_spec(spec) if isinstance(spec, str) else spec
    micro_batch_size = positive_int("micro_batch_size", micro_batch_size)
    seq_len = positive_int("seq_len", seq_len)
    repeats = positive_int("repeats", repeats)
    before = torch.get_num_threads()
    torch.set_num_threads(positive_int("threads", threads))
    try:
        return _layer_costs(build_model(spec, seed=seed), spec, micro_batch_size, seq_len, repeats)
    finally:
        torch.set_num_threads(before)


def _layer_costs(model, spec, micro_batch_size: int, seq_len: int, repeats: int) -> list[float]:
    tokens = torch.randint(0, spec.vocab_size, (micro_batch_size, seq_len))

    def timed(fn) -> float:
        ts = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return min(ts[1:])

    def embed_fb():
        model.embed_tokens(tokens).sum().backward()

    h = model.embed_tokens(tokens).detach()
    costs = []
    for layer in model.layers:
        x = h.clone().requires_grad_(True)
        costs.append(timed(lambda layer=layer, x=x: layer(x).sum().backward()))

    def head_fb():
        lm_loss_local(model.head(h.clone().requires_grad_(True))).backward()

    def lm_loss_local(logits):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1))

    costs[0] += timed(embed_fb)
    costs[-1] += timed(head_fb)
    model.zero_grad(set_to_none=True)
    return costs


# ------------------------------------------------------------------------------------------------------
# views for chapter 06 (plotly imported lazily)
# ------------------------------------------------------------------------------------------------------
def gantt(result, step: int = 0, title: str | None = None):
    """Per-rank Gantt of one step: a :class:`PipelineRun` (measured; its title names the compute mode) or a
    :class:`labkit.theory.simulate.SimResult` (predicted). Bars are coloured by op and labelled by micro-batch."""
    from labkit.plots import timeline_figure

    if isinstance(result, sim.SimResult):
        s = result.schedule
        df = result.to_frame(step=step)
        vs = f" v={s.v}" if s.v > 1 else ""
        title = title or (f"{s.name} pp={s.p} m={s.m}{vs} — simulated (bubble "
                          f"{result.bubble_fraction:.3f} of total time)")
    else:
        df = result.timeline[result.timeline["step"] == step]
        title = title or f"{result.title()}; bubble {result.steps['bubble_fraction'].iloc[step]:.3f}"
    return timeline_figure(df, color_by="name", label="microbatch", title=title)


def bubble_figure(runs: Sequence[PipelineRun], title: str | None = None):
    """Bubble fraction vs n_microbatches per schedule: measured (markers), simulator and formula (lines)."""
    import plotly.graph_objects as go

    rows = pd.DataFrame([r.summary() for r in runs]).sort_values("n_microbatches")
    fig = go.Figure()
    for name, g in rows.groupby("schedule", sort=False):
        fig.add_trace(go.Scatter(x=g["n_microbatches"], y=g["bubble_measured"], mode="markers",
                                 marker_size=10, name=f"{name} measured"))
        fig.add_trace(go.Scatter(x=g["n_microbatches"], y=g["bubble_simulated"], mode="lines",
                                 name=f"{name} simulator (predicted)"))
        fig.add_trace(go.Scatter(x=g["n_microbatches"], y=g["bubble_formula"], mode="lines",
                                 line_dash="dot", name=f"{name} formula (predicted)"))
    compute = ", ".join(sorted(rows["compute"].unique()))
    fig.update_layout(title=title or f"Bubble fraction (fraction of total time) vs micro-batches — "
                                     f"measured ({compute} compute) beside predictions",
                      xaxis_title="n_microbatches (m)", yaxis_title="bubble_fraction", xaxis_type="log")
    return fig


def memory_figure(runs: Sequence[PipelineRun], title: str | None = None):
    """Peak saved activations per rank (MB = 1e6 bytes, measured by saved_tensors_hooks) for each run."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for r in runs:
        if r.peak_saved_bytes[0] is None:
            continue
        fig.add_trace(go.Bar(x=[f"rank {i}" for i in range(r.schedule.p)],
                             y=[b / 1e6 for b in r.peak_saved_bytes], name=r.job["label"],
                             text=[f"{n} in flight" for n in r.peak_inflight], textposition="outside"))
    fig.update_layout(title=title or "Peak saved activations per rank — measured (real compute)",
                      yaxis_title="MB (1e6 bytes)", barmode="group")
    return fig
