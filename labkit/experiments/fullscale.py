"""Full scale on a laptop: the lab's strategies at a real model's shapes under fake tensors
(:mod:`labkit.runtime.fake`), memory measured beside the calculator and steps emulated beside the planner.

Entry points (plain data; chapters 01, 04 and 09 call these):

* :func:`measure_memory` — one strategy, one model: the per-rank peak measured by
  ``torch.distributed._tools.mem_tracker.MemTracker`` under FakeTensorMode (label ``measured (fake tensors)``)
  beside :func:`labkit.theory.memory.train_memory`'s prediction for the same layout, per category, with the
  phase (forward / backward / optimizer) and module where the peak occurs.
* :func:`memory_table` — many (strategy, model) pairs: a list of rows with predicted, measured and ratio.
* :func:`emulate_mesh` — one DP x TP x PP mesh of a preset traced at full shapes (one traced rank per
  pipeline stage, every other rank its stage's trace relabelled), replayed on a cluster profile, beside the
  planner's predicted step time (``labkit plan --emulate N``).

What is run, per strategy (one AdamW step, bf16 parameters and activations, AdamW states in bf16 as torch keeps
them for bf16 parameters, ``foreach=False``; the optimizer's state is created by a step on zero gradients
before the measured step, so the peak is a steady-state step's):

=========  ==========================================================================================
ddp        the lab's bucketed DDP :class:`labkit.parallel.data.bucketed.DataParallelBucket` (25 MiB
           buckets, overlapped all-reduce; torch's C++ reducer cannot run on fake tensors): dp = N, ZeRO 0
zero1/2/3  the lab's :class:`labkit.parallel.zero.ZeroDataParallel` (dp = N, ZeRO 1/2/3, even shards)
fsdp2      torch ``fully_shard`` on every layer and the root (dp = N, ZeRO 3, ``shard_layout="dim0"``)
tp_sp      the lab's :func:`labkit.parallel.tensor.model.apply_tp` with sequence parallelism (tp = N)
pp         the lab's :class:`labkit.parallel.pipeline.stage.StageModule` for each stage; 1F1B's in-flight
           micro-batches (stage k runs min(m, pp - k) forwards before its first backward, Narayanan et al.
           2021) run by this module's loop, the gradient arriving from the next stage a fake tensor
ep         (MoE presets) the lab's :class:`labkit.parallel.expert.ep.ExpertParallelMoE` in every MoE layer over
           the world, attention replicated (calculator: dp = ep = N); routing as :data:`UNIFORM_ROUTING`
=========  ==========================================================================================

MoE presets under any strategy run their routing as :data:`UNIFORM_ROUTING` (the lab's routing reads token
counts from data: ``bincount(...).tolist()``); the result's ``assumptions`` says so.

Rank symmetry: data-parallel and tensor-parallel ranks hold the same shapes (ZeRO / FSDP2 shards differ by at
most one row per tensor; rank 0 holds the most), so rank 0 is measured for ddp, zero*, fsdp2 and tp_sp; for pp
every stage is measured (the first holds the most micro-batches, the last the head and the logits).
"""

from __future__ import annotations

import math
import time

from labkit.checks import check_choice, positive_int

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp2", "tp_sp", "pp", "ep")
#: what a fake run assumes where the real program's shapes depend on data (MoE routing)
UNIFORM_ROUTING = ("uniform routing: every expert receives N*top_k/E of the N tokens' assignments (no drops; "
                   "the router, its softmax and top-k run at full shape, their values unused)")
LABEL = "measured (fake tensors)"
#: MemTracker's categories -> the calculator's
_CATEGORY = {"Parameter": "parameters", "Buffer": "parameters", "Gradient": "gradients", "Optstate": "optimizer",
             "Activation": "activations", "Temp": "temporary", "Other": "temporary"}
MEASURED_CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporary")


# ------------------------------------------------------------------------------------------------------
# inside the (fake) rank
# ------------------------------------------------------------------------------------------------------
def _peak_tracker():
    """A MemTracker that keeps only the global peak and where it happened (torch's records every module's
    peak on every operation, 4x slower at 70B and not needed here)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class PeakTracker(MemTracker):
        def __init__(self):
            super().__init__()
            self.peak_phase, self.peak_module = "", ""
            self.phase = "forward"

        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)
                    self.peak_phase = ("optimizer" if self._in_opt else "backward" if self._mod_tracker.is_bw
                                       else "forward")
                    parents = [p for p in self._mod_tracker.parents if p != "Global"]
                    self.peak_module = max(parents, key=len) if parents else ""

    return PeakTracker()


def _uniform_moe_forward(self, x):
    """:class:`labkit.parallel.expert.MoE` forward under :data:`UNIFORM_ROUTING` (fixed shapes, no data read):
    x [..., H] -> [..., H]. Assignment a of the N·k goes to token a mod N and expert a·E // (N·k)."""
    import torch

    from labkit.parallel.expert.moe import _run_experts

    flat = x.reshape(-1, x.shape[-1])  # (N, H)
    n, k, e = flat.shape[0], self.top_k, self.n_experts
    probs = torch.softmax(self.router(flat).float(), dim=-1).to(flat.dtype)  # (N, E)
    gate, _ = torch.topk(probs, k, dim=-1)  # (N, k)
    tok = torch.arange(n * k) % n  # (A,)
    out = _run_experts(self.experts, flat[tok], _even(n * k, e))  # (A, H)
    y = torch.zeros_like(flat).index_add(0, tok, out * gate.t().reshape(-1)[:, None].to(out.dtype))  # (N, H)
    self.last_routing, self.aux_loss = None, None
    return y.view_as(x)


def _uniform_ep_forward(self, x):
    """:class:`labkit.parallel.expert.ep.ExpertParallelMoE` forward under :data:`UNIFORM_ROUTING`: the counts
    all-to-all, the dispatch and combine all-to-alls of the lab's EP (``_AllToAllV``) with N·k/ep rows to and
    from every rank, the local experts on N·k/E rows each. x [..., H] -> [..., H]."""
    import torch
    import torch.distributed as dist

    from labkit.parallel.expert.ep import _AllToAllV
    from labkit.parallel.expert.moe import _run_experts

    g, ep, n_local = self.group, self.ep, self.n_local
    flat = x.reshape(-1, x.shape[-1])  # (N, H)
    n, k = flat.shape[0], self.top_k
    probs = torch.softmax(self.router(flat).float(), dim=-1).to(flat.dtype)  # (N, E)
    gate, _ = torch.topk(probs, k, dim=-1)  # (N, k)
    counts = torch.empty(self.n_experts, dtype=torch.int64)
    dist.all_to_all_single(torch.empty_like(counts), counts, group=g)  # (E,): the counts exchange
    rows = _even(n * k, ep)  # rows to (and from) each rank
    tok = torch.arange(n * k) % n  # (A,)
    received = _AllToAllV.apply(flat[tok], rows, rows, g, self.timeline, "dispatch")  # (A, H)
    out = _run_experts(self.experts, received, _even(n * k, n_local))  # (A, H)
    back = _AllToAllV.apply(out, rows, rows, g, self.timeline, "combine")  # (A, H)
    y = torch.zeros_like(flat).index_add(0, tok, back * gate.t().reshape(-1)[:, None].to(back.dtype))  # (N, H)
    self.last_routing, self.aux_loss, self.last_stats = None, None, {"assumption": UNIFORM_ROUTING}
    return y.view_as(x)


def _even(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal counts (the first ones one larger)."""
    q, r = divmod(total, parts)
    return [q + (i < r) for i in range(parts)]


def _adamw(params):
    import torch

    return torch.optim.AdamW(params, lr=1e-4, foreach=False)


def _warm_state(opt) -> None:
    """Create the optimizer's state (a step on zero gradients), as after the first real step."""
    import torch

    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def memory_rank(ctx, model: str, strategy: str, *, seq_len: int = 8192, micro_batch_size: int = 1,
                n_microbatches: int = 1, n_layers: int | None = None) -> dict:
    """Rank function (run under ``launch(..., fake=True)``): build ``model`` at its real shapes in bf16, apply
    ``strategy`` over the world (module docstring), run one measured training step, and return this rank's
    peak: ``{"rank", "peak_bytes", "categories" (bytes: parameters, gradients, optimizer, activations,
    temporary), "peak_phase", "peak_module", "seconds"}``. For ``pp`` the world is the pipeline (one stage
    per rank, ``n_microbatches`` micro-batches). ``n_layers`` overrides the preset's layer count (tests)."""
    import torch
    import torch.distributed as dist

    from labkit.models import lm_loss
    from labkit.theory.spec import get_spec

    t0 = time.perf_counter()
    spec = get_spec(model, **({"n_layers": n_layers} if n_layers else {}))
    n = ctx.world_size
    tokens = torch.randint(0, spec.vocab_size, (micro_batch_size, seq_len))
    assumptions = []
    if spec.is_moe:
        from labkit.parallel.expert import MoE
        from labkit.parallel.expert.ep import ExpertParallelMoE

        MoE.forward, ExpertParallelMoE.forward = _uniform_moe_forward, _uniform_ep_forward  # this child only
        assumptions.append(UNIFORM_ROUTING)
    elif strategy == "ep":
        raise ValueError(f"strategy 'ep' needs a mixture-of-experts model; {model!r} has no experts")
    lo, hi = _stage_range(spec.n_layers, n, ctx.rank) if strategy == "pp" else (0, spec.n_layers)
    full = _build(spec, hi - lo)  # pp: only this stage's layers (same shapes), not 8 copies of the whole model
    full.train()
    steps = []  # what one measured step runs: callables
    tracker = _peak_tracker()
    after_forward: dict = {}

    def fwd_bwd():
        loss = lm_loss(runner(tokens), tokens)
        after_forward.update(_categories(tracker.get_tracker_snapshot("current"))[0])
        loss.backward()
    if strategy == "ddp":
        from labkit.parallel.data.bucketed import DataParallelBucket

        runner = DataParallelBucket(full)  # torch's DDP reducer (C++) cannot run on fake tensors
        steps.append(fwd_bwd)
    elif strategy in ("zero1", "zero2", "zero3"):
        from labkit.parallel.zero import ZeroDataParallel

        runner = ZeroDataParallel(full, int(strategy[-1]))
        steps.append(fwd_bwd)
    elif strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (n,))
        for layer in full.layers:
            fully_shard(layer, mesh=mesh)
        runner = fully_shard(full, mesh=mesh)
        steps.append(fwd_bwd)
    elif strategy == "tp_sp":
        from labkit.parallel.tensor.model import apply_tp

        runner = apply_tp(full, dist.group.WORLD, sequence_parallel=True)
        steps.append(fwd_bwd)
    elif strategy == "ep":
        from labkit.parallel.expert import MoE
        from labkit.parallel.expert.ep import ExpertParallelMoE

        for layer in full.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp = ExpertParallelMoE(layer.mlp)  # this rank's E/ep experts; the rest freed
        runner = full
        steps.append(fwd_bwd)
    elif strategy == "pp":
        from labkit.parallel.pipeline.stage import StageModule

        runner = StageModule(full, ctx.rank, n, (0, hi - lo))
        fly = min(n_microbatches, n - ctx.rank)

        class MicroBatch(torch.nn.Module):  # one per micro-batch: MemTracker refuses a root called twice
            def __init__(self, stage):
                super().__init__()
                self.stage = stage

            def forward(self, x):
                return self.stage(x)

        def pipeline_step():
            outs = []
            for _ in range(fly):  # 1F1B warm-up: min(m, pp - k) forwards before the first backward
                x = tokens if runner.is_first else torch.randn(micro_batch_size, seq_len, spec.hidden_size,
                                                               dtype=torch.bfloat16, requires_grad=True)
                outs.append(MicroBatch(runner)(x))
            for y in outs:
                if runner.is_last:
                    lm_loss(y, tokens).backward()
                else:
                    y.backward(torch.randn_like(y))  # the gradient received from stage k + 1

        steps.append(pipeline_step)
    else:
        check_choice("strategy", strategy, STRATEGIES)
    opt = _adamw([p for p in runner.parameters() if p.requires_grad])
    _warm_state(opt)
    tracker.track_external(runner, opt)
    with tracker:
        for s in steps:
            s()
        opt.step()
        after_step = _categories(tracker.get_tracker_snapshot("current"))[0]
        opt.zero_grad(set_to_none=True)
    cats, total = _categories(tracker.get_tracker_snapshot("peak"))
    return {"rank": ctx.rank, "peak_bytes": total, "categories": cats, "peak_phase": tracker.peak_phase,
            "peak_module": tracker.peak_module, "after_forward": dict(after_forward), "after_step": after_step,
            "assumptions": assumptions, "seconds": time.perf_counter() - t0}


def _categories(snapshot: dict) -> tuple[dict, int]:
    """(bytes per calculator category, total) of a MemTracker snapshot (one device)."""
    snap = next(iter(snapshot.values()), {})
    cats = dict.fromkeys(MEASURED_CATEGORIES, 0)
    total = 0
    for k, v in snap.items():
        name = getattr(k, "value", k)
        if name == "Total":
            total = int(v)
        elif name in _CATEGORY:
            cats[_CATEGORY[name]] += int(v)
    return cats, total


def _build(spec, n_layers: int):
    """The lab's Transformer of ``spec`` with ``n_layers`` layers, in bf16, no weights drawn (fake tensors hold
    no values; a fake tensor cannot be cast in place by ``.to()``, so it is built in bf16)."""
    from dataclasses import replace

    import torch

    from labkit.models import Transformer

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return Transformer(replace(spec, n_layers=n_layers) if n_layers != spec.n_layers else spec)
    finally:
        torch.set_default_dtype(old)


def _stage_range(n_layers: int, pp: int, stage: int) -> tuple[int, int]:
    """Layers [first, end) of ``stage``: an even split, the remainder on the middle stages as the
    calculator's default split does (``labkit.theory.memory.stages``)."""
    from labkit.theory.memory.config import ParallelConfig

    split = ParallelConfig(pp=pp).split(n_layers)
    first = sum(split[:stage])
    return first, first + split[stage]


# ------------------------------------------------------------------------------------------------------
# the caller's side
# ------------------------------------------------------------------------------------------------------
def predicted_memory(model: str, strategy: str, world_size: int, *, seq_len: int = 8192,
                     micro_batch_size: int = 1, n_microbatches: int = 1, n_layers: int | None = None,
                     stage: int | None = None, rank: int = 0):
    """labkit.theory.memory's training estimate for what :func:`memory_rank` runs (no headroom, no workspace:
    the fake run has neither): a :class:`labkit.theory.memory.MemoryEstimate`."""
    from labkit.experiments.memory import train_config
    from labkit.theory import memory as mem
    from labkit.theory.spec import get_spec

    spec = get_spec(model, **({"n_layers": n_layers} if n_layers else {}))
    n = world_size
    par = {"ddp": dict(dp=n), "zero1": dict(dp=n, zero=1), "zero2": dict(dp=n, zero=2),
           "zero3": dict(dp=n, zero=3), "fsdp2": dict(dp=n, zero=3, shard_layout="dim0"),
           "tp_sp": dict(tp=n, sequence_parallel=True), "pp": dict(pp=n, schedule="1f1b"),
           "ep": dict(dp=n, ep=n)}[strategy]
    train = train_config(spec, micro_batch_size, seq_len, "sdpa", "bfloat16", "cpu")
    from dataclasses import replace

    train = replace(train, n_microbatches=n_microbatches)
    return mem.train_memory(spec, mem.ParallelConfig(**par), train, headroom=0.0, workspace_bytes=0,
                            stage=stage, dp_rank=rank if strategy == "fsdp2" else 0)


def measure_memory(model: str = "llama-3-8b", strategy: str = "fsdp2", world_size: int = 8, *,
                   seq_len: int = 8192, micro_batch_size: int = 1, n_microbatches: int | None = None,
                   n_layers: int | None = None, device: str | None = None, timeout_s: float = 1200.0) -> dict:
    """Measure one strategy's per-rank training peak at full shapes under fake tensors, beside the calculator.

    Args: ``model`` a preset (data/models.yaml); ``strategy`` one of :data:`STRATEGIES`; ``world_size`` the
    strategy's degree (dp for ddp/zero*/fsdp2, tp for tp_sp, pp for pp); ``seq_len`` and ``micro_batch_size``
    per rank; ``n_microbatches`` (pp; default pp); ``n_layers`` a layer-count override; ``device`` a name from
    data/hardware.yaml: the verdict (fits / does not fit, naming the category and the phase of the peak).

    Returns plain data: ``model, strategy, world_size, label`` ("measured (fake tensors)"),
    ``predicted_peak_bytes``, ``measured_peak_bytes``, ``ratio`` (measured / predicted), ``predicted``
    and ``measured`` (bytes per category), ``peak_phase``, ``peak_module``, ``stage`` (pp: the stage with
    the highest measured peak, whose figures these are), ``after_forward`` / ``after_step`` (measured bytes per
    category at the end of the forward and right after the optimizer step, before ``zero_grad``: every
    model state resident), ``per_stage`` (pp), ``fits`` / ``verdict`` (with a
    device), ``traced_ranks``, ``wall_s`` (measured seconds).

    Raises ValueError for an unknown model or strategy, bad sizes, or a layout the calculator refuses.
    """
    from labkit.runtime.fake import launch_fake
    from labkit.theory.spec import get_spec

    check_choice("strategy", strategy, STRATEGIES)
    world_size = positive_int("world_size", world_size)
    spec = get_spec(model, **({"n_layers": n_layers} if n_layers else {}))
    spec.check_seq_len(seq_len)
    m = world_size if n_microbatches is None else positive_int("n_microbatches", n_microbatches)
    m = m if strategy == "pp" else 1
    predicted_memory(model, strategy, world_size, seq_len=seq_len, micro_batch_size=micro_batch_size,
                     n_microbatches=m, n_layers=n_layers)  # the calculator's checks, before anything runs
    roles = (lambda r: r) if strategy == "pp" else (lambda r: 0)
    res = launch_fake(memory_rank, world_size, model, strategy, roles=roles, timeout_s=timeout_s,
                      seq_len=seq_len, micro_batch_size=micro_batch_size, n_microbatches=m, n_layers=n_layers)
    per_rank = {r: res[r] for r in res.traced}
    worst = max(per_rank, key=lambda r: per_rank[r]["peak_bytes"])
    got = per_rank[worst]
    est = predicted_memory(model, strategy, world_size, seq_len=seq_len, micro_batch_size=micro_batch_size,
                           n_microbatches=m, n_layers=n_layers, stage=worst if strategy == "pp" else None)
    pred = {k: int(est.categories.get(k, 0)) for k in ("parameters", "gradients", "optimizer", "activations",
                                                        "temporary", "communication")}
    out = {"model": model, "strategy": strategy, "world_size": world_size, "seq_len": seq_len,
           "micro_batch_size": micro_batch_size, "n_microbatches": m, "n_layers": spec.n_layers, "label": LABEL,
           "predicted_label": "predicted (labkit.theory.memory.train_memory)",
           "predicted_peak_bytes": int(est.total_bytes), "measured_peak_bytes": int(got["peak_bytes"]),
           "ratio": got["peak_bytes"] / est.total_bytes if est.total_bytes else math.nan,
           "predicted": pred, "measured": dict(got["categories"]), "peak_phase": got["peak_phase"],
           "peak_module": got["peak_module"], "after_forward": got["after_forward"], "after_step": got["after_step"],
           "stage": worst if strategy == "pp" else None,
           "per_stage": ({r: per_rank[r]["peak_bytes"] for r in sorted(per_rank)} if strategy == "pp" else None),
           "assumptions": got["assumptions"], "traced_ranks": list(res.traced), "wall_s": res.wall_s}
    if device is not None:
        from labkit.theory.memory import get_device, usable_bytes

        cap = usable_bytes(get_device(device))
        big = max(got["categories"], key=lambda k: got["categories"][k])
        out["fits"] = got["peak_bytes"] <= cap
        where = f"{got['peak_phase']}" + (f" in {got['peak_module']}" if got["peak_module"] else "")
        out["verdict"] = (f"fits on {device}: peak {got['peak_bytes'] / 2**30:.2f} GiB of {cap / 2**30:.2f} GiB "
                          f"usable" if out["fits"] else
                          f"does not fit on {device}: peak {got['peak_bytes'] / 2**30:.2f} GiB > {cap / 2**30:.2f} "
                          f"GiB usable, reached in the {where}; the largest category is {big} "
                          f"({got['categories'][big] / 2**30:.2f} GiB)")
    return out


def memory_table(models=("llama-3-8b",), strategies=STRATEGIES, world_size: int = 8, **kwargs) -> list[dict]:
    """:func:`measure_memory` for every (strategy, model): rows of ``strategy, model, world_size,
    predicted_peak_bytes, measured_peak_bytes, ratio, peak_phase`` (plain data, a chapter's table)."""
    rows = []
    for model in models:
        for s in strategies:
            r = measure_memory(model, s, world_size, **kwargs)
            rows.append({k: r[k] for k in ("strategy", "model", "world_size", "predicted_peak_bytes",
                                           "measured_peak_bytes", "ratio", "peak_phase", "wall_s")})
    return rows


# ------------------------------------------------------------------------------------------------------
# full-scale emulation: one traced rank per pipeline stage
# ------------------------------------------------------------------------------------------------------
def step_rank(ctx, dp: int, tp: int, pp: int, *, model: str = "llama-3-70b", seq_len: int = 8192,
              micro_batch_size: int = 1, n_microbatches: int = 8, n_layers: int | None = None) -> dict:
    """Rank function (fake run): one training step of ``model`` at its real shapes on a dp x tp x pp mesh
    (:class:`labkit.theory.mesh.ParallelDims` order, TP innermost) — the lab's TP (:func:`apply_tp`, Megatron
    column/row layers, no SP) of this rank's stage's layers, 1F1B over ``n_microbatches`` micro-batches
    (:func:`labkit.theory.simulate.make_schedule`) with ``irecv``/``isend`` of [mbs, T, H] activations and
    their gradients, the stage's gradients all-reduced over its DP group by the lab's
    :class:`DataParallelBucket` (overlapping the last micro-batch's backward), then AdamW. bf16 throughout.
    Returns ``{"stage", "coords", "layers"}`` (no loss: a fake run has no values)."""
    import torch
    import torch.distributed as dist

    from labkit.experiments.emulate import _Stage, one_f_one_b_step
    from labkit.parallel.data import DataParallelBucket
    from labkit.parallel.tensor import apply_tp
    from labkit.theory.mesh import ParallelDims
    from labkit.theory.simulate import make_schedule
    from labkit.theory.spec import get_spec

    dims = ParallelDims(ctx.world_size, dp=dp, tp=tp, pp=pp)
    spec = get_spec(model, **({"n_layers": n_layers} if n_layers else {}))
    m, mbs = n_microbatches, micro_batch_size
    groups = {}
    for dim in ("tp", "dp"):
        for g in dims.groups(dim):  # only this rank's groups: the fake backend needs no global agreement
            if ctx.rank in g:
                groups[dim] = dist.new_group(g, use_local_synchronization=True)
    coords = dims.coords(ctx.rank)
    s = coords["pp"]
    first, last = s == 0, s == pp - 1
    lo, hi = _stage_range(spec.n_layers, pp, s)
    full = _build(spec, hi - lo)  # only this stage's layers (same shapes as the preset's)
    tpm = apply_tp(full, groups["tp"])
    stage = _Stage(tpm, range(hi - lo), first, last)
    dpm = DataParallelBucket(stage, group=groups["dp"])
    opt = _adamw(list(stage.parameters()))
    actions = make_schedule("1f1b", pp, m).actions[s]
    prev = dims.rank_of(tp=coords["tp"], dp=coords["dp"], pp=s - 1) if not first else None
    nxt = dims.rank_of(tp=coords["tp"], dp=coords["dp"], pp=s + 1) if not last else None
    tokens = torch.randint(0, spec.vocab_size, (mbs, seq_len))
    dist.barrier()  # the step starts here: emulate_mesh drops the set-up (parameter broadcasts) before it
    one_f_one_b_step(actions, tpm, stage, dpm, stage_index=s, m=m, first=first, last=last, prev=prev, nxt=nxt,
                     shape=(mbs, seq_len, spec.hidden_size), inputs=lambda mb: tokens, targets=lambda mb: tokens,
                     dtype=torch.bfloat16, keep_loss=False)
    opt.step()
    dpm.close()
    return {"stage": s, "coords": coords, "layers": [lo, hi]}


def step_events(trace: list) -> list:
    """The events of ``trace`` after its first barrier (:func:`step_rank`'s step start): set-up dropped."""
    for i, ev in enumerate(trace):
        if ev[0] == "coll" and ev[4] == "barrier":
            return list(trace[i + 1:])
    return list(trace)


def compress_trace(trace: list, cluster) -> list:
    """``trace`` with every run of consecutive compute events replaced by one ``("s", t0, t1, seconds)`` event
    charged what the replay would charge them on ``cluster`` (the sum of
    :func:`labkit.theory.replay._op_cost_ns` over the run, in integer ns): the same replay result, with only
    the communication left as events — what makes 1024 or 16,384 ranks replayable in seconds. The tracer's
    ``u`` events (measured, never charged) are dropped. Exact when the profile's ``comm_compute_share`` is 0
    (the default); with a share, a merged run's slow-down while communication is in flight is computed once
    for the run instead of per operation."""
    from labkit.theory.replay import Charge, _op_cost_ns

    charge = Charge()
    out, run_ns, t0, t1 = [], 0, None, None
    costs: dict = {}
    for ev in trace:
        if ev[0] == "c":
            d = costs.get(ev[3:])
            if d is None:  # shape-aware where the event has a kind and shape (gemm, attention)
                d = costs[ev[3:]] = _op_cost_ns(cluster, charge, ev[3], ev[4], ev[5], ev[6] if len(ev) > 6 else None,
                                                ev[7] if len(ev) > 7 else None)
            run_ns += d
            t0 = ev[1] if t0 is None else t0
            t1 = ev[2]
            continue
        if ev[0] == "u":  # measured, never charged (the replay lists them): dropped, so runs stay whole
            continue
        if ev[0] == "s":
            run_ns += int(round(ev[3] * 1e9))
            t0 = ev[1] if t0 is None else t0
            t1 = ev[2]
            continue
        if t0 is not None:
            out.append(("s", t0, t1, run_ns / 1e9))
            run_ns, t0 = 0, None
        out.append(ev)
    if t0 is not None:
        out.append(("s", t0, t1, run_ns / 1e9))
    return out


def emulate_mesh(model: str = "llama-3-70b", cluster: str = "dgx-h100", *, dp: int = 16, tp: int = 8, pp: int = 8,
                 seq_len: int = 8192, micro_batch_size: int = 1, n_microbatches: int = 8,
                 n_layers: int | None = None, timeout_s: float = 1800.0) -> dict:
    """Emulate one training step of ``model`` on a dp x tp x pp mesh of ``cluster`` from fake traces at the
    real shapes: one rank per pipeline stage is traced (tp = dp = 0; TP ranks run the same shapes and DP
    replicas the same program, so every other rank gets its stage's trace relabelled by the mesh shift:
    :func:`labkit.runtime.fake.mesh_roles` with ``symmetric=("dp", "tp")``), compute runs pre-priced
    (:func:`compress_trace`), and all ``dp*tp*pp`` ranks replayed (:func:`labkit.theory.replay.replay`).

    Returns plain data: ``emulated_s`` (the step's makespan, label ``emulated (<cluster>, fake tensors)``),
    ``per_stage`` (per stage: ``compute_s``, ``waiting_s`` of its tp=dp=0 rank), ``traced_ranks``,
    ``trace_s`` (measured seconds tracing), ``replay_s`` (measured), ``wall_s``, ``events`` (per rank, after
    compression), ``mesh``. Raises ValueError for degrees that do not fit the cluster or model.
    """
    from labkit.runtime import emulate as _em
    from labkit.runtime.fake import expand_traces, launch_fake, mesh_roles
    from labkit.theory.mesh import ParallelDims

    t0 = time.perf_counter()
    dims = ParallelDims(dp * tp * pp, dp=dp, tp=tp, pp=pp)
    plan = _em.resolve(cluster, dims.world_size)
    roles = mesh_roles(dims, symmetric=("dp", "tp"))
    res = launch_fake(step_rank, dims.world_size, dp, tp, pp, roles=roles, timeout_s=timeout_s, model=model,
                      seq_len=seq_len, micro_batch_size=micro_batch_size, n_microbatches=n_microbatches,
                      n_layers=n_layers, record=True)
    traced = {r: compress_trace(step_events(t), plan.cluster) for r, t in res.fake_traces.items()}
    t1 = time.perf_counter()
    from labkit.theory.replay import replay

    rr = replay(expand_traces(traced, roles, dims), plan.cluster)
    replay_s = time.perf_counter() - t1
    comm: dict = {}
    for c in rr.comm:
        if c["rank"] == 0:
            comm[c["op"]] = comm.get(c["op"], 0.0) + (c["end_ns"] - c["start_ns"]) / 1e9
    per_stage = [{"stage": dims.coords(r)["pp"], "rank": r, "compute_s": rr.compute_ns[r] / 1e9,
                  "waiting_s": rr.waits[r] / 1e9, "end_s": rr.end_ns[r] / 1e9} for r in sorted(traced)]
    return {"model": model, "cluster": cluster, "mesh": {"dp": dp, "tp": tp, "pp": pp},
            "world_size": dims.world_size, "seq_len": seq_len, "micro_batch_size": micro_batch_size,
            "n_microbatches": n_microbatches, "label": f"emulated ({plan.cluster.name}, fake tensors)",
            "emulated_s": rr.makespan_ns / 1e9, "per_stage": per_stage, "traced_ranks": sorted(traced),
            "comm_s_rank0": comm, "trace_s": dict(res.trace_s), "replay_s": replay_s,
            "events": {r: len(t) for r, t in traced.items()},
            "wall_s": time.perf_counter() - t0}


#: the emulator's cluster profile for a planner GPU (``labkit plan --emulate``)
PROFILE_OF_GPU = {"h100-80gb": "dgx-h100", "a100-80gb": "dgx-a100"}


def planner_step(model: str, cluster: str, *, dp: int, tp: int, pp: int, seq_len: int = 8192,
                 n_microbatches: int = 8, micro_batch_size: int = 1) -> float | None:
    """The planner's predicted step time (seconds, ``predicted (labkit.theory.planner)``) of the dp x tp x pp
    mesh (cp = ep = 1) on ``cluster``'s GPU and node size, global batch dp·mbs·m; None when the planner
    rejects that mesh (it does not fit, or breaks a rule). The planner picks its own schedule and recompute."""
    from labkit.runtime import emulate as _em
    from labkit.theory import planner

    cl = _em.resolve(cluster, dp * tp * pp).cluster
    res = planner.plan(model, gpus=dp * tp * pp, global_batch_size=dp * micro_batch_size * n_microbatches,
                       seq_len=seq_len, gpu=cl.device.name, gpus_per_node=cl.gpus_per_node,
                       micro_batch_sizes=[micro_batch_size])
    for c in res.candidates:
        if (c.dp, c.tp, c.pp, c.cp, c.ep) == (dp, tp, pp, 1, 1):
            return c.step_time_s
    return None


def emulate_candidates(candidates, model: str, gpu: str, *, seq_len: int, n: int, timeout_s: float = 1800.0) \
        -> list[dict]:
    """``labkit plan --emulate N``: the first ``n`` planner candidates (cp = ep = 1; others are listed as not
    emulated, with the reason) emulated by :func:`emulate_mesh` on the GPU's DGX profile, each beside its
    predicted step time. Rows: ``rank, dp, tp, pp, schedule, predicted_s, emulated_s, ratio, label, note``.
    Raises ValueError for a GPU without a cluster profile (:data:`PROFILE_OF_GPU`)."""
    if gpu not in PROFILE_OF_GPU:
        raise ValueError(f"--emulate needs a cluster profile for gpu={gpu!r}; valid: {', '.join(PROFILE_OF_GPU)}")
    rows = []
    for c in list(candidates)[:n]:
        row = {"rank": c.rank, "dp": c.dp, "tp": c.tp, "pp": c.pp, "cp": c.cp, "ep": c.ep,
               "schedule": c.schedule, "micro_batch_size": c.micro_batch_size, "n_microbatches": c.n_microbatches,
               "predicted_s": c.step_time_s, "emulated_s": None, "ratio": None, "label": "", "note": ""}
        if c.cp != 1 or c.ep != 1:
            row["note"] = "not emulated: the full-scale step runs dp x tp x pp only (cp, ep not wired)"
        else:
            r = emulate_mesh(model, PROFILE_OF_GPU[gpu], dp=c.dp, tp=c.tp, pp=c.pp, seq_len=seq_len,
                             micro_batch_size=c.micro_batch_size, n_microbatches=c.n_microbatches or 1,
                             timeout_s=timeout_s)
            row.update(emulated_s=r["emulated_s"], ratio=r["emulated_s"] / c.step_time_s, label=r["label"],
                       note=f"1F1B, no recompute, no SP, ZeRO 0 (planner: {c.schedule}, recompute {c.recompute}); "
                            f"traced ranks {r['traced_ranks']}")
        rows.append(row)
    return rows
