"""Experiments that check the emulator against theory, and the emulated collective sweep.

Rank functions (first argument ``ctx``, for :func:`labkit.launch`):

* :func:`bucket_overlap_rank` — data parallelism on a stack of square linear layers, one bucket per layer:
  naive (blocking all-reduces after backward), bucketed (async all-reduces from gradient hooks) and torch DDP
  (with and without a comm hook), each step timed as one ``ctx.timer`` span;
* :func:`step3d_rank` — one DP x TP x PP training step of the lab's model from the lab's pieces: Megatron TP
  (:func:`labkit.parallel.tensor.apply_tp`) inside each stage, a hand-written 1F1B pipeline between stages
  (isend/irecv), bucketed data parallelism (:class:`labkit.parallel.data.DataParallelBucket`) whose
  all-reduces overlap the last micro-batch's backward;
* :func:`collectives_rank` — every (op, S) case once between barriers, the tensor small and charged as S
  (:func:`labkit.runtime.emulate.charge_bytes`).

Callers' side: :func:`emulated_sweep` (the nccl-tests-like table of emulated collectives beside the cost
model), :func:`bucket_overlap_table` (emulated DDP steps beside :func:`labkit.theory.data.overlapped_step_s`)
and :func:`step3d_vs_planner` (an emulated DP x TP x PP step beside :func:`labkit.theory.planner.step_time`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.checks import check_choice, positive_int

BUCKET_VARIANTS = ("naive", "bucket", "ddp", "ddp_nohook")


# ------------------------------------------------------------------------------------------------------
# data parallelism: overlap or not
# ------------------------------------------------------------------------------------------------------
def _square_stack(n_layers: int, width: int, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    layers = [nn.Linear(width, width, bias=False) for _ in range(n_layers)]
    with torch.no_grad():
        for lin in layers:
            lin.weight.copy_(torch.randn(width, width, generator=g) / width ** 0.5)
    return nn.Sequential(*layers)


def bucket_overlap_rank(ctx, variants=BUCKET_VARIANTS, *, n_layers: int = 4, width: int = 128,
                        batch_size: int = 32, steps: int = 2, seed: int = 0) -> dict:
    """Rank function: ``steps`` SGD steps of ``n_layers`` square ``nn.Linear(width, width, bias=False)`` layers on
    this rank's batch [batch_size, width], for each data-parallel variant of :data:`BUCKET_VARIANTS`, one bucket
    per layer (``bucket_cap_bytes`` = one weight). Each step is one ``ctx.timer(variant, step=i)`` span.

    Per layer the forward is one matmul (2 b w^2 FLOPs) and the backward two (input and weight gradients),
    the first layer's one (its input needs no gradient). Returns {variant: final weight sum} (equal on every
    rank: the replicas stay identical). Raises ValueError for an unknown variant or a non-positive size."""
    from labkit.parallel.data import DataParallelBucket, DataParallelNaive, torch_ddp

    for v in variants:
        check_choice("variant", v, BUCKET_VARIANTS)
    n_layers, width = positive_int("n_layers", n_layers), positive_int("width", width)
    batch_size, steps = positive_int("batch_size", batch_size), positive_int("steps", steps)
    cap = width * width * 4
    out = {}
    for variant in variants:
        model = _square_stack(n_layers, width, seed).to(ctx.device)
        if variant == "naive":
            wrapped = DataParallelNaive(model, ctx=ctx)
        elif variant == "bucket":
            wrapped = DataParallelBucket(model, ctx=ctx, bucket_cap_bytes=cap, first_bucket_cap_bytes=cap)
        else:
            wrapped = torch_ddp(model, ctx=ctx, bucket_cap_bytes=cap, log_comm=variant == "ddp")
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(seed + 1 + ctx.rank)
        ctx.barrier()
        for step in range(steps):
            x = torch.randn(batch_size, width, generator=g, device=ctx.device)  # [b, w]
            with ctx.timer(variant, step=step):
                opt.zero_grad(set_to_none=True)
                loss = wrapped(x).pow(2).mean()  # [b, w] -> scalar
                loss.backward()
                if hasattr(wrapped, "finish_grad_sync"):
                    wrapped.finish_grad_sync()
                opt.step()
        ctx.barrier()
        if hasattr(wrapped, "close"):
            wrapped.close()
        out[variant] = float(sum(p.detach().sum() for p in model.parameters()))
    return out


def bucket_overlap_costs(cluster, *, n_layers: int = 4, width: int = 128, batch_size: int = 32,
                         world_size: int = 2) -> dict:
    """The per-part costs :func:`bucket_overlap_rank`'s step has on ``cluster`` when memory traffic is free
    (an infinite memory bandwidth): ``forward_s``, ``backward_s`` (per bucket, in launch order: the last layer's
    bucket first), ``comm_s`` (per bucket: one all-reduce of a weight), all *predicted* from the formulas of
    :meth:`labkit.theory.cluster.Cluster.compute_s` and :meth:`~labkit.theory.cluster.Cluster.collective_s`."""
    mm = 2 * batch_size * width * width
    fwd = n_layers * cluster.compute_s(mm, 0)
    bwd = [2 * cluster.compute_s(mm, 0)] * (n_layers - 1) + [cluster.compute_s(mm, 0)]
    comm = [cluster.collective_s("all_reduce", width * width * 4, tuple(range(world_size)))] * n_layers
    return {"forward_s": fwd, "backward_s": bwd, "comm_s": comm}


def bucket_overlap_table(emulation, frame, cluster=None, **sizes) -> list[dict]:
    """Emulated step time of each variant in ``frame`` (the emulated timeline of a
    :func:`bucket_overlap_rank` launch, median over steps, slowest rank) beside
    :func:`labkit.theory.data.overlapped_step_s` with and without overlap. Rows: ``variant``, ``emulated_s``
    (labelled by ``source``), ``predicted_overlap_s``, ``predicted_serial_s``."""
    import statistics

    from labkit.theory.data import overlapped_step_s

    cluster = cluster or emulation.cluster
    parts = bucket_overlap_costs(cluster, world_size=int(frame["rank"].nunique()), **sizes)
    over = overlapped_step_s(parts["forward_s"], parts["backward_s"], parts["comm_s"], overlap=True)
    serial = overlapped_step_s(parts["forward_s"], parts["backward_s"], parts["comm_s"], overlap=False)
    rows = []
    for variant in BUCKET_VARIANTS:
        g = frame[(frame["name"] == variant) & (frame["stream"] == "compute")]
        if not len(g):
            continue
        per_step = g.groupby("step").apply(lambda d: (d["end_ns"].max() - d["start_ns"].min()) / 1e9,
                                           include_groups=False)
        rows.append({"variant": variant, "emulated_s": statistics.median(per_step.tolist()),
                     "predicted_overlap_s": over["step_s"], "predicted_serial_s": serial["step_s"],
                     "source": emulation.label})
    return rows


# ------------------------------------------------------------------------------------------------------
# DP x TP x PP
# ------------------------------------------------------------------------------------------------------
class _Stage(nn.Module):
    """The parameters one pipeline stage of a TPTransformer holds (what its data-parallel wrapper syncs)."""

    def __init__(self, tpm, layer_ids, first: bool, last: bool):
        super().__init__()
        self.embed = tpm.embed if first else None
        self.layers = nn.ModuleList(tpm.layers[i] for i in layer_ids)
        self.norm = tpm.norm if last else None
        self.lm_head = tpm.lm_head if last else None


def one_f_one_b_step(actions, tpm, stage, dpm, *, stage_index: int, m: int, first: bool, last: bool, prev, nxt,
                     shape: tuple, inputs, targets, dtype=None, device=None, timer=None,
                     keep_loss: bool = True) -> float:
    """One pipeline step of one stage on its 1F1B ``actions`` (:func:`labkit.theory.simulate.make_schedule`):
    every receive posted first (``irecv`` of [mbs, T, H] activations from ``prev``, of their gradients from
    ``nxt``), then each action's forward (``stage.layers`` of the TP model ``tpm``: the embedding on the first
    stage, the head and loss / ``m`` on the last) or backward, ``isend`` of its output or input gradient; the
    last micro-batch's backward lets ``dpm`` (a :class:`~labkit.parallel.data.DataParallelBucket`) launch its
    buckets; then every send waited and the gradients synchronised. ``inputs(mb)`` / ``targets(mb)`` give the
    micro-batch's token ids [mbs, T]; ``timer(name, **tags)`` (e.g. ``ctx.timer``) times each F and B when
    given. Tags: ``2·m·s + mb`` forward into stage s, ``2·m·s + m + mb`` backward out of it. Returns the sum of
    the last stage's micro-batch losses (0.0 elsewhere, or when ``keep_loss`` is False: a fake-tensor run has
    no values)."""
    import contextlib

    s = stage_index
    recvs = {}
    for a in actions:  # every receive posted at the start of the step
        if a.op == "F" and not first:
            buf = torch.empty(shape, dtype=dtype, device=device)  # [mbs, T, H]
            recvs[("F", a.microbatch)] = (dist.irecv(buf, src=prev, tag=2 * m * s + a.microbatch), buf)
        elif a.op == "B" and not last:
            buf = torch.empty(shape, dtype=dtype, device=device)  # [mbs, T, H]
            recvs[("B", a.microbatch)] = (dist.irecv(buf, src=nxt, tag=2 * m * (s + 1) + m + a.microbatch), buf)
    sends, held, total = [], {}, 0.0
    for a in actions:
        mb = a.microbatch
        timed = timer(a.op, microbatch=mb) if timer is not None else contextlib.nullcontext()
        if a.op == "F":
            if first:
                x = inputs(mb)  # [mbs, T] int64
            else:
                work, x = recvs.pop(("F", mb))
                work.wait()
                x.requires_grad_(True)  # [mbs, T, H]
            with timed:
                y = tpm.embed_tokens(x) if first else x
                for layer in stage.layers:
                    y = layer(y)  # [mbs, T, H]
                if last:
                    y = tpm.loss(tpm.head(y), targets(mb)) / m  # scalar
                    if keep_loss:
                        total += float(y.detach())
            held[mb] = (x, y)
            if not last:
                sends.append(dist.isend(y.detach(), dst=nxt, tag=2 * m * (s + 1) + mb))
        else:
            x, y = held.pop(mb)
            grad = None
            if not last:
                work, grad = recvs.pop(("B", mb))
                work.wait()
            if mb == m - 1:
                dpm._pending = True  # this backward completes every gradient: its hooks launch the buckets
            with timed:
                torch.autograd.backward(y, grad_tensors=grad)
            if not first:
                sends.append(dist.isend(x.grad, dst=prev, tag=2 * m * s + m + mb))
    for w in sends:
        w.wait()
    dpm.finish_grad_sync()
    return total


def step3d_rank(ctx, dp: int, tp: int, pp: int, *, model: str = "lab-tiny-llama", seq_len: int = 32,
                micro_batch_size: int = 1, n_microbatches: int = 4, steps: int = 2, lr: float = 1e-3,
                seed: int = 0, data_seed: int = 0) -> dict:
    """Rank function: ``steps`` training steps of the lab's model on a dp x tp x pp mesh (world = dp*tp*pp;
    :class:`labkit.theory.mesh.ParallelDims` order, TP innermost).

    Each rank builds the full model, keeps its TP shard (:func:`labkit.parallel.tensor.apply_tp` over its TP
    group) of its stage's layers (stage = pp coordinate; the first stage also the embedding, the last the
    final norm, head and the vocab-parallel loss), and runs the 1F1B schedule of
    :func:`labkit.theory.simulate.make_schedule` over ``n_microbatches`` micro-batches of
    [micro_batch_size, seq_len] tokens: every receive posted at the start of the step (``irecv``), sends with
    ``isend``; activations [mbs, T, H] forward, their gradients backward. The stage's parameters are wrapped in
    :class:`labkit.parallel.data.DataParallelBucket` over its DP group; its bucket all-reduces are launched
    during the last micro-batch's backward (overlapping it) and waited before the AdamW step. Each step is a
    ``ctx.timer("step", step=i)`` span with ``F``/``B`` spans inside (tags stage, microbatch).

    Returns ``{"losses": per step (last stage, mean over the global batch), "stage", "coords"}`` (losses None
    off the last stage). Raises ValueError for degrees that do not multiply to the world size or do not divide
    the model (layers by pp, heads by tp).
    """
    from labkit.models import SyntheticLM, build_model, make_optimizer, shard
    from labkit.parallel.data import DataParallelBucket
    from labkit.parallel.tensor import apply_tp
    from labkit.theory.mesh import ParallelDims
    from labkit.theory.simulate import make_schedule
    from labkit.theory.spec import get_spec

    dims = ParallelDims(ctx.world_size, dp=dp, tp=tp, pp=pp)
    spec = get_spec(model)
    from labkit.checks import check_divides

    check_divides("pp", pp, "n_layers", spec.n_layers)
    m, mbs = positive_int("n_microbatches", n_microbatches), positive_int("micro_batch_size", micro_batch_size)
    groups = {}
    for dim in ("tp", "dp", "pp"):
        for g in dims.groups(dim):
            pg = dist.new_group(g)
            if ctx.rank in g:
                groups[dim] = (pg, g)
    coords = dims.coords(ctx.rank)
    s = coords["pp"]
    first, last = s == 0, s == pp - 1
    per = spec.n_layers // pp
    full = build_model(spec, seed, device=ctx.device)
    tpm = apply_tp(full, groups["tp"][0])
    stage = _Stage(tpm, range(s * per, (s + 1) * per), first, last)
    dpm = DataParallelBucket(stage, ctx=ctx, group=groups["dp"][0])
    opt = make_optimizer(list(stage.parameters()), lr)
    actions = make_schedule("1f1b", pp, m).actions[s]
    prev = dims.rank_of(tp=coords["tp"], dp=coords["dp"], pp=s - 1) if not first else None
    nxt = dims.rank_of(tp=coords["tp"], dp=coords["dp"], pp=s + 1) if not last else None
    data = SyntheticLM(spec.vocab_size, seq_len, data_seed)
    gbs = dp * mbs * m
    losses = []

    for step in range(steps):
        tokens, targets = data.batch(step, gbs)  # [gbs, T]
        tokens, targets = shard(tokens, coords["dp"], dp), shard(targets, coords["dp"], dp)  # [mbs*m, T]
        ctx.barrier()
        with ctx.timer("step", step=step):
            opt.zero_grad(set_to_none=True)
            total = one_f_one_b_step(
                actions, tpm, stage, dpm, stage_index=s, m=m, first=first, last=last, prev=prev, nxt=nxt,
                shape=(mbs, seq_len, spec.hidden_size), inputs=lambda mb, t=tokens: shard(t, mb, m),
                targets=lambda mb, t=targets: shard(t, mb, m), device=ctx.device,
                timer=lambda name, step=step, **tags: ctx.timer(name, step=step, stage=s, **tags))
            with ctx.timer("optimizer", "other", step=step):
                opt.step()
        losses.append(total if last else None)
    if last:
        t = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(t, group=groups["dp"][0])
        losses = (t / dp).tolist()
    dpm.close()
    return {"losses": losses, "stage": s, "coords": coords}


def step3d_charge(dims, *, preset: str = "llama-3-8b", seq_len: int = 8192, micro_batch_size: int = 1,
                  lab_model: str = "lab-tiny-llama", lab_seq_len: int = 32, lab_micro_batch_size: int = 1,
                  cluster="dgx-h100") -> dict:
    """The ``emulate=`` dict that charges a :func:`step3d_rank` run as ``preset`` (labkit.runtime.emulate)."""
    return {"cluster": cluster, "model": preset, "seq_len": seq_len, "micro_batch_size": micro_batch_size,
            "lab_model": lab_model, "lab_seq_len": lab_seq_len, "lab_micro_batch_size": lab_micro_batch_size,
            "dims": dims}


def step3d_vs_planner(emulation, frame, dims, *, preset: str = "llama-3-8b", seq_len: int = 8192,
                      micro_batch_size: int = 1, n_microbatches: int = 4) -> dict:
    """An emulated :func:`step3d_rank` step beside :func:`labkit.theory.planner.step_time` for the same mesh,
    model preset and cluster, and the explanation of their difference, in numbers.

    ``frame`` is the emulated timeline (``LaunchResult.emulated``). The planner is called with zero=0
    (replicated DP), no sequence parallelism, 2-byte gradients and activations and ``mfu`` = the profile's
    ``compute_efficiency``. Returned (seconds; ``source`` says which are emulated, the rest are predicted):

    * ``emulated_s`` — median over steps of the slowest rank's ``step`` span; ``planner_s``, ``ratio``;
    * ``stage_f_s`` / ``stage_b_s`` — per stage, the median emulated F and B span of one micro-batch (TP
      communication inside them), ``imbalance`` = slowest stage's F+B / mean stage's;
    * ``p2p_s`` (median emulated transfer), ``optimizer_s`` (emulated), ``tail_s`` = emulated step minus the
      last F/B end (DP all-reduce left exposed + optimizer);
    * ``simulated_s`` — :func:`labkit.theory.simulate.simulate` of the same 1F1B schedule fed the per-stage
      costs above and ``p2p_s``, plus ``tail_s``: the emulated step explained by its per-stage costs;
    * ``balanced_s`` — the same with every stage given the mean stage's costs: what the planner's balanced
      model (compute + (pp-1)/m bubble) would see with the emulator's per-operation charges;
    * ``planner`` — the planner's parts.
    """
    import statistics

    from labkit.theory import planner
    from labkit.theory.simulate import OpCosts, make_schedule, simulate
    from labkit.theory.spec import get_spec

    cl = emulation.cluster
    topo = planner.Topology(cl.device.name, cl.gpus_per_node, cl.intra, cl.inter or cl.intra,
                            cl.device.peak_flops("bf16"), cl.device.memory_bytes, cl.base_latency_s)
    spec, m, pp = get_spec(preset), n_microbatches, dims.pp
    gbs = dims.dp * micro_batch_size * m
    pred = planner.step_time(spec, dims, topo, seq_len=seq_len, global_batch_size=gbs,
                             micro_batch_size=micro_batch_size, zero=0, sequence_parallel=False,
                             mfu=cl.compute_efficiency)
    comp = frame[frame["stream"] == "compute"]

    def dur(df):
        return (df["end_ns"] - df["start_ns"]) / 1e9

    steps = comp[comp["name"] == "step"]
    per_step = steps.groupby("step").apply(lambda d: (d["end_ns"].max() - d["start_ns"].min()) / 1e9,
                                           include_groups=False)
    emulated = float(statistics.median(per_step.tolist()))
    fb = comp[comp["name"].isin(["F", "B"])]
    med = fb.assign(d=dur(fb)).groupby(["name", "stage"])["d"].median()
    f = tuple(float(med[("F", s)]) for s in range(pp))
    b = tuple(float(med[("B", s)]) for s in range(pp))
    comm = frame[frame["stream"] == "comm"]
    p2p = comm[comm["dim"] == "pp"]
    p2p_s = float(dur(p2p).median()) if len(p2p) else 0.0
    opt = comp[comp["name"] == "optimizer"]
    tails = []
    for step, g in steps.groupby("step"):
        last_fb = fb[(fb["step"] == step)]["end_ns"].max()
        tails.append((g["end_ns"].max() - last_fb) / 1e9)
    tail = float(statistics.median(tails))
    sched = make_schedule("1f1b", pp, m)
    simulated = float(simulate(sched, OpCosts(f=f, b=b, w=0.0, p2p_s=p2p_s)).makespan_s + tail)
    fm, bm = statistics.mean(f), statistics.mean(b)
    balanced = float(simulate(sched, OpCosts(f=fm, b=bm, w=0.0, p2p_s=p2p_s)).makespan_s + tail)
    stage = [x + y for x, y in zip(f, b)]
    return {"emulated_s": emulated, "planner_s": pred["step_time_s"], "ratio": emulated / pred["step_time_s"],
            "stage_f_s": f, "stage_b_s": b, "imbalance": max(stage) / statistics.mean(stage), "p2p_s": p2p_s,
            "optimizer_s": float(dur(opt).median()) if len(opt) else 0.0, "tail_s": tail,
            "simulated_s": simulated, "balanced_s": balanced, "planner": pred, "source": emulation.label}


def step3d_findings(cmp: dict, tolerance: float = 0.10) -> list[str]:
    """Sentences from :func:`step3d_vs_planner`'s numbers: the agreement, or why it is missed."""
    e, p, r = cmp["emulated_s"], cmp["planner_s"], cmp["ratio"]
    out = [f"{cmp['source']}: one step takes {e:.3f} s; the planner predicts {p:.3f} s (ratio {r:.3f})."]
    if abs(r - 1) <= tolerance:
        out.append(f"They agree within {tolerance:.0%}.")
        return out
    out.append(f"They differ by more than {tolerance:.0%}: the planner gives every pipeline stage the same work, "
               f"but the slowest stage here does {cmp['imbalance']:.2f}x the mean stage's (the last stage also "
               "computes the output head and the loss), and 1F1B's step is set by the slowest stage.")
    out.append(f"Fed the emulated per-stage costs, the 1F1B simulator gives {cmp['simulated_s']:.3f} s "
               f"({cmp['simulated_s'] / e - 1:+.1%} of emulated); with the stages balanced it gives "
               f"{cmp['balanced_s']:.3f} s ({cmp['balanced_s'] / p - 1:+.1%} of the planner).")
    return out


# ------------------------------------------------------------------------------------------------------
# collectives, emulated
# ------------------------------------------------------------------------------------------------------
def collectives_rank(ctx, cases, *, real_nbytes: int = 4096, dtype: str = "float32") -> int:
    """Rank function: for each (op, S) of ``cases``, a barrier, then one ``op`` (all_reduce, all_gather,
    reduce_scatter, broadcast, all_to_all, or send_recv between ranks 0 and 1) on a small real buffer of about
    ``real_nbytes`` bytes, charged as S (:func:`labkit.runtime.emulate.charge_bytes`). Returns the number of
    cases run. The times are the emulated timeline's; unemulated the run only checks the calls."""
    from labkit.runtime.emulate import charge_bytes

    n = ctx.world_size
    dt = getattr(torch, dtype)
    count = max(n, (real_nbytes // torch.empty(0, dtype=dt).element_size()) // n * n)
    x = torch.ones(count, dtype=dt, device=ctx.device)  # [count]
    for op, s in cases:
        dist.barrier()
        with charge_bytes(int(s)):
            if op == "all_reduce":
                dist.all_reduce(x)
            elif op == "all_gather":
                out = torch.empty(count * n, dtype=dt, device=ctx.device)  # [n * count]
                dist.all_gather_into_tensor(out, x)
            elif op == "reduce_scatter":
                out = torch.empty(count // n, dtype=dt, device=ctx.device)  # [count / n]
                dist.reduce_scatter_tensor(out, x)
            elif op == "broadcast":
                dist.broadcast(x, src=0)
            elif op == "all_to_all":
                out = torch.empty_like(x)  # [count]
                dist.all_to_all_single(out, x)
            elif op == "send_recv":
                if ctx.rank == 0:
                    dist.send(x, dst=1)
                elif ctx.rank == 1:
                    dist.recv(x, src=0)
            else:
                raise ValueError(f"op={op!r} is not valid; choose one of: all_reduce, all_gather, "
                                 "reduce_scatter, broadcast, all_to_all, send_recv")
    dist.barrier()
    return len(cases)


def sweep_cases(ops, sizes) -> list[tuple[str, int]]:
    """Every (op, S) of ``ops`` x ``sizes``, validated (ValueError for an unknown op or a size < 1)."""
    from labkit.theory import costmodel

    ops = list(ops)
    for op in ops:
        check_choice("op", op, costmodel.OPS)
    return [(op, positive_int("size", s)) for op in ops for s in sizes]


def emulated_sweep(ops, sizes, world_size: int, emulate="dgx-h100", *, timeout_s: float = 300.0,
                   echo: bool = False):
    """Emulate each op of ``ops`` at each S of ``sizes`` on ``world_size`` ranks (one launch of
    :func:`collectives_rank`) and return :func:`sweep_table` of it. Raises ValueError for an unknown op or
    profile, a world size the profile cannot hold, or a size < 1, before any process starts."""
    from labkit.runtime.emulate import resolve
    from labkit.runtime.launcher import launch

    cases = sweep_cases(ops, sizes)
    world_size = positive_int("world_size", world_size, minimum=2)
    plan = resolve(emulate, world_size)
    res = launch(collectives_rank, world_size, cases, emulate=plan, timeout_s=timeout_s, echo=echo)
    return sweep_table(res.emulation, cases)


def sweep_table(emulation, cases):
    """The emulated collectives of a :func:`collectives_rank` run (its :class:`labkit.runtime.emulate.Emulation`,
    or one repriced on another profile) as nccl-tests' table: ``op, world_size, bytes, time_s, algbw_gbps,
    busbw_gbps`` (busbw = algbw x the nccl-tests factor of the op's group size), ``link`` (the slowest link the
    op's group crossed), ``predicted_s`` (the cost model alone for the same placement:
    :meth:`labkit.theory.cluster.Cluster.collective_s` / ``p2p_s``), ``source`` (``emulated (<profile>)``)."""
    import pandas as pd

    from labkit.theory import costmodel

    comm = emulation.comm_frame()
    comm = comm[comm["op"] != "barrier"]
    world_size = len(emulation.traces)
    cl = emulation.cluster
    rows = []
    for (op, s), (_, g) in zip(cases, _by_instance(comm), strict=True):
        ranks = g["group"].iloc[0]
        t = float((g["end_ns"].max() - g["start_ns"].min()) / 1e9)
        alg = s / t / 1e9 if t > 0 else float("inf")
        pred = cl.p2p_s(ranks[0], ranks[1], s) if op == "send_recv" else cl.collective_s(op, s, ranks)
        rows.append({"op": op, "world_size": world_size, "bytes": s, "time_s": t, "algbw_gbps": alg,
                     "busbw_gbps": alg * costmodel.bus_factor(op, len(ranks)), "link": g["link"].iloc[0],
                     "predicted_s": pred, "source": emulation.label})
    return pd.DataFrame(rows)


def _by_instance(comm):
    """The replay's communication rows grouped into instances (same start, op and group), in time order."""
    keys = comm.assign(key=list(zip(comm["start_ns"], comm["op"], comm["group"])))
    for key in sorted(set(keys["key"]), key=lambda k: k[0]):
        yield key, keys[keys["key"] == key]


# ------------------------------------------------------------------------------------------------------
# adversarial programs: each way a program can wait, share a link, name a group, or hide work (issue 27)
# ------------------------------------------------------------------------------------------------------
WAIT_STYLES = ("wait", "future", "then", "wait_all", "collect_all", "poll", "never")


def wait_style_rank(ctx, style: str = "wait", *, nbytes: int = 2**30, before_s: float = 0.001,
                    after_s: float = 0.002) -> float:
    """Rank function: one async all-reduce charged as ``nbytes``, ``before_s`` of compute (a sleep) beside it,
    a wait in one of :data:`WAIT_STYLES` (``Work.wait``; ``get_future().wait()``; a ``then()`` chain's
    future; ``torch.futures.wait_all``; ``collect_all(...).wait()``; polling ``is_completed()``; never), then
    ``after_s`` of compute. Returns the reduced sum (= world_size * 4; -1 for ``never``, which cannot read it).
    Emulated, every waiting style ends at max(before, comm) + after; ``never`` at max(before + after, comm),
    the all-reduce listed never waited."""
    import time

    from labkit.runtime.emulate import charge_bytes

    check_choice("style", style, WAIT_STYLES)
    x = torch.ones(4)
    with charge_bytes(int(nbytes)):
        work = dist.all_reduce(x, async_op=True)
    time.sleep(before_s)
    if style == "wait":
        work.wait()
    elif style == "future":
        work.get_future().wait()
    elif style == "then":
        work.get_future().then(lambda f: f.value()).wait()
    elif style == "wait_all":
        torch.futures.wait_all([work.get_future()])
    elif style == "collect_all":
        torch.futures.collect_all([work.get_future()]).wait()
    elif style == "poll":
        while not work.is_completed():
            pass
    time.sleep(after_s)
    if style == "never":  # the result is not read: it may not have arrived (the handle stays alive to here)
        return -1.0 if work is not None else -2.0
    return float(x.sum())


def link_share_rank(ctx, pattern: str = "one", *, nbytes: int = 2**30) -> int:
    """Rank function on 2+ ranks, ``nbytes`` charged in all: ``"one"`` — rank 0 isends one message to rank 1;
    ``"split"`` — the same bytes as 8 concurrent isends; ``"fanout"`` — rank 0 isends ``nbytes`` to every
    other rank at once; ``"beside"`` — an all-reduce on ranks {0, 1} concurrent with a send 0 -> 1 (each
    ``nbytes``). Returns the number of messages this rank took part in."""
    from labkit.runtime.emulate import charge_bytes

    check_choice("pattern", pattern, ("one", "split", "fanout", "beside"))
    n, r = ctx.world_size, ctx.rank
    works, count = [], 0
    if pattern in ("one", "split"):
        k = 1 if pattern == "one" else 8
        with charge_bytes(int(nbytes) // k):
            for i in range(k):
                if r == 0:
                    works.append(dist.isend(torch.ones(4), 1, tag=i))
                elif r == 1:
                    works.append(dist.irecv(torch.empty(4), 0, tag=i))
        count = len(works)
    elif pattern == "fanout":
        with charge_bytes(int(nbytes)):
            if r == 0:
                works = [dist.isend(torch.ones(4), d) for d in range(1, n)]
            else:
                works = [dist.irecv(torch.empty(4), 0)]
        count = len(works)
    else:
        pair = dist.new_group([0, 1])
        with charge_bytes(int(nbytes)):
            if r < 2:
                works.append(dist.all_reduce(torch.ones(4), group=pair, async_op=True))
                works.append(dist.isend(torch.ones(4), 1) if r == 0 else dist.irecv(torch.empty(4), 0))
        count = len(works)
    for w in works:
        w.wait()
    return count


def two_groups_rank(ctx, ops=("all_reduce", "all_reduce"), *, sizes=(2**20, 32)) -> list:
    """Rank function on 2 ranks: two process groups of the same members {0, 1}; rank 0 issues ``ops[0]`` of
    ``sizes[0]`` on the first and ``ops[1]`` of ``sizes[1]`` on the second, rank 1 in the other order (both
    async, then waited: legal for real, each group its own communicator). Returns each result's sum."""
    from labkit.runtime.emulate import charge_bytes

    g = [dist.new_group([0, 1]), dist.new_group([0, 1])]
    order = (0, 1) if ctx.rank == 0 else (1, 0)
    bufs, works = {}, []
    for i in order:
        with charge_bytes(int(sizes[i])):
            if ops[i] == "all_gather":
                out = [torch.empty(4) for _ in range(ctx.world_size)]
                works.append(dist.all_gather(out, torch.ones(4), group=g[i], async_op=True))
                bufs[i] = out
            else:
                t = torch.ones(4)
                works.append(dist.all_reduce(t, group=g[i], async_op=True))
                bufs[i] = [t]
    for w in works:
        w.wait()
    return [float(sum(t.sum() for t in bufs[i])) for i in (0, 1)]


def disagree_rank(ctx, sizes=(2**20, 2**20)) -> float:
    """Rank function: one all-reduce, rank r charged as ``sizes[r]`` bytes (members that disagree: a
    ReplayError when emulated)."""
    from labkit.runtime.emulate import charge_bytes

    x = torch.ones(4)
    with charge_bytes(int(sizes[ctx.rank])):
        dist.all_reduce(x)
    return float(x.sum())


def hidden_work_rank(ctx, where: str = "torch", *, n: int = 384, repeats: int = 20) -> float:
    """Rank function: ``repeats`` matmuls of [n, n] @ [n, n], in torch (priced) or in numpy (``"numpy"``: the
    tracer cannot see it), or ``"inverse"``: ``torch.linalg.inv`` (no FLOP formula: charged by bytes, listed
    unpriced); an all-reduce at each end. Returns a checksum."""
    check_choice("where", where, ("torch", "numpy", "inverse"))
    dist.all_reduce(torch.ones(1))
    g = torch.Generator().manual_seed(ctx.rank)
    a = torch.randn(n, n, generator=g) / n ** 0.5 + torch.eye(n)  # [n, n]
    acc = 0.0
    if where == "numpy":
        x = a.numpy()
        for _ in range(repeats):
            acc += float((x @ x)[0, 0])
    elif where == "inverse":
        for _ in range(repeats):
            acc += float(torch.linalg.inv(a)[0, 0])
    else:
        for _ in range(repeats):
            acc += float((a @ a)[0, 0])
    dist.all_reduce(torch.ones(1))
    return acc


def early_recv_rank(ctx, early: bool = False, *, nbytes: int = 2**28, compute_s: float = 0.002) -> float:
    """Rank function on 2 ranks, a two-stage pipeline: rank 0 computes ``compute_s`` then isends an
    activation charged as ``nbytes``; rank 1 irecvs it and computes on it, after waiting (correct) or
    ``early`` — before the receive completed (a dependency violation). Returns the received sum."""
    import time

    from labkit.runtime.emulate import charge_bytes

    buf = torch.zeros(16)
    if ctx.rank == 0:
        time.sleep(compute_s)
        with charge_bytes(int(nbytes)):
            dist.isend(torch.ones(16), 1).wait()
        return 16.0
    with charge_bytes(int(nbytes)):
        work = dist.irecv(buf, 0)
    if not early:
        work.wait()
    y = (buf * 2).sum()  # consumes the received activation
    time.sleep(compute_s)
    if early:
        work.wait()
    return float(y) / 2
