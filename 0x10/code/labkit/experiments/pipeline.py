"""Pipeline runs on real ranks, measured: the rank function, its launchers, and what a timeline says.

Two implementations side by side, run by one rank function (:func:`pipeline_rank`):

* ``impl="labkit"`` — hand-written (:class:`labkit.parallel.pipeline.ScheduleRunner`): each rank walks
  ``schedule.actions[rank]`` (the very lists the simulator runs), receives activations / gradients with
  ``irecv`` posted at the start of the step, sends with ``isend``, and waits on *every* work handle. Compute
  is ``"fixed"`` (each op sleeps its configured F/B/W duration) or ``"real"`` (the lab's model cut into
  ``pp * v`` stages). In ZB-H1 the backward is split: B computes input gradients and queues each
  ``nn.Linear``'s weight-gradient matmul, W runs the queue (Qi et al. 2023, Sec. 2).
* ``impl="torch"`` — ``torch.distributed.pipelining`` (:class:`labkit.parallel.pipeline.TorchPipeline`) on the
  same stage modules, its ``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``
  timed into the timeline (so its action order is observed, not assumed).

Timeline events (labkit.runtime.timeline columns): ``F``/``B``/``W`` (kind compute), ``recv`` (kind comm: the wait
on an irecv handle — mostly waiting for the producing stage), ``send`` (kind comm: posting an isend),
``idle`` (kind idle: gaps between events inside a step), ``optim`` and ``tied_grad`` (after the flush).
Tags: step (timed steps from 0; warm-up steps are dropped), microbatch, stage (global stage index).

Measured bubble (what :func:`bubble_from_timeline` computes per step, fraction of total time)::

    bubble_fraction = 1 - sum_r busy_r / (p * makespan)

busy_r = time rank r spends in F/B/W; makespan = first F start to last F/B/W end over all ranks.

Use :func:`run_pipeline` (one configuration) or :func:`run_pipelines` (several in one launch); both check
their arguments before anything starts (:func:`labkit.theory.pipeline.check_job`: ValueError naming the fix).
The hand-written runner is gloo-only (it posts every ``irecv`` of a step up front, which gloo matches by tag
and completes asynchronously but NCCL's in-order p2p streams would serialise into a deadlock); on NCCL use
``impl="torch"``.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F

from labkit.checks import positive_int
from labkit.parallel.pipeline import (
    ScheduleRunner,
    StageCompute,
    StandInCompute,
    TorchPipeline,
    build_stages,
    named_grads,
)
from labkit.runtime import timeline as tl
from labkit.theory import simulate as sim
from labkit.theory.pipeline import COMPUTE_OPS, check_job
from labkit.theory.simulate import OpCosts, Schedule


# ------------------------------------------------------------------------------------------------------
# the rank function
# ------------------------------------------------------------------------------------------------------
def pipeline_rank(ctx, jobs: Sequence[dict]) -> list[dict]:
    """Rank function: run each (already validated, see :func:`labkit.theory.pipeline.check_job`) job in turn;
    ``launch`` it with ``world_size = pp``. Returns one dict per job: ``events`` (this rank's timeline events
    of the job), ``step_s`` (wall time of each timed step on this rank), ``losses`` (last stage's rank, real
    compute), ``peak_inflight`` (most (stage, micro-batch) activation sets held at once), ``peak_saved_bytes``
    (real compute: autograd's saved tensors of those sets, excluding parameters; for ZB-H1 they are
    counted until W, an upper bound, since B frees the graph and only the queued matmuls' inputs stay), ``handles``
    (p2p handles created / waited), ``grads`` (when asked). The order the ops ran in is read from ``events``
    (:func:`observed_order`)."""
    out = []
    for job in jobs:
        start = len(ctx.timeline.events)
        res = _run_torch(ctx, job, start) if job["impl"] == "torch" else _run_labkit(ctx, job, start)
        res["events"] = ctx.timeline.events[start:]
        del ctx.timeline.events[start:]
        res["offset_ns"] = ctx.timeline.offset_ns
        out.append(res)
        ctx.barrier()
    return out


def _schedule_for(job: dict, pp: int) -> Schedule:
    return sim.make_schedule(job["schedule"], pp, job["n_microbatches"], job["v"])


def _real_setup(ctx, job: dict, sched: Schedule):
    """The real-compute pieces both impls share: full model + this rank's stages, their unique parameters,
    the optimizer (None when lr = 0) and the synthetic data."""
    from labkit.models import SyntheticLM, make_optimizer

    spec = job["spec"]
    model, stages = build_stages(spec, sched.stages_of(ctx.rank), job["layers_per_stage"], seed=job["seed"],
                                 device=ctx.device)
    params = list({id(p): p for s in stages.values() for p in s.parameters()}.values())
    opt = make_optimizer(params, job["lr"]) if job["lr"] > 0 else None
    return model, stages, params, opt, SyntheticLM(spec.vocab_size, job["seq_len"], job["data_seed"])


def _train(ctx, job: dict, job_start: int, run_step, *, params=(), opt=None, data=None, on_timed_start=None):
    """The step loop of both impls: ``warmup_steps`` untimed then ``steps`` timed steps, each after a barrier:
    zero the gradients, ``run_step(step, batch)`` (returns the step's loss or None), the optimizer step, then
    this rank's gaps recorded as ``idle``. Returns (step_s, losses) of the timed steps."""
    step_s, losses = [], []
    for it in range(job["warmup_steps"] + job["steps"]):
        step = max(it - job["warmup_steps"], -1)  # warm-up steps are tagged -1
        ctx.barrier()
        if it == job["warmup_steps"]:  # drop the warm-up steps' events
            del ctx.timeline.events[job_start:]
            if on_timed_start is not None:
                on_timed_start()
        first_event = len(ctx.timeline.events)
        t_start = ctx.now_ns()
        batch = data.batch(it, job["global_batch_size"]) if data is not None else None  # tokens, targets [B, T]
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        else:
            for p in params:
                p.grad = None
        loss = run_step(step, batch)
        if opt is not None:
            with ctx.timeline.span("optim", "other", step=step):
                opt.step()
        losses.append(loss)
        t_end = ctx.now_ns()
        _fill_idle(ctx, t_start, t_end, first_event, step)
        step_s.append((t_end - t_start) / 1e9)
    return step_s[job["warmup_steps"]:], losses[job["warmup_steps"]:]


def _run_labkit(ctx, job: dict, job_start: int) -> dict:
    sched = _schedule_for(job, ctx.world_size)
    real = job["compute"] == "real"
    last_rank = sched.rank_of(sched.n_stages - 1)
    if real:
        from labkit.models import lm_loss

        spec = job["spec"]
        model, stages, params, opt, data = _real_setup(ctx, job, sched)
        act_shape = (job["global_batch_size"] // sched.m, job["seq_len"], spec.hidden_size)  # [b, T, H]
        compute = StageCompute(ctx, sched, stages, lm_loss, act_shape=act_shape,
                               act_dtype=next(model.parameters()).dtype, params=params, tied=spec.tied_embeddings)
    else:
        params, opt, data = (), None, None
        compute = StandInCompute(ctx, job["costs"].op_seconds(sched), job["fixed_nbytes"])
    runner = ScheduleRunner(ctx, sched, compute)

    def run_step(step, batch):
        if real:
            compute.set_batch(*batch)
        runner.step(step)
        return compute.loss if real and ctx.rank == last_rank else None

    step_s, losses = _train(ctx, job, job_start, run_step, params=params, opt=opt, data=data)
    res = {"step_s": step_s, "losses": losses if real else [], "peak_inflight": runner.peak_inflight,
           "peak_saved_bytes": compute.peak_saved_bytes if real else None,
           "handles": (runner.p2p.created, runner.p2p.waited), "rank": ctx.rank}
    if real and job.get("return_grads"):
        res["grads"] = named_grads(model, stages)
    return res


def _run_torch(ctx, job: dict, job_start: int) -> dict:
    from labkit.models import lm_loss

    sched = _schedule_for(job, ctx.world_size)
    spec = job["spec"]
    model, stages, params, opt, data = _real_setup(ctx, job, sched)
    pipe = TorchPipeline(ctx, sched, stages, lm_loss, micro_batch_size=job["global_batch_size"] // sched.m,
                         seq_len=job["seq_len"], hidden_size=spec.hidden_size, tied=spec.tied_embeddings)
    step_s, losses = _train(ctx, job, job_start, lambda step, batch: pipe.step(*batch, step=step), params=params,
                            opt=opt, data=data)
    res = {"step_s": step_s, "losses": losses, "peak_inflight": None, "peak_saved_bytes": None, "handles": None,
           "rank": ctx.rank}
    if job.get("return_grads"):
        res["grads"] = named_grads(model, stages)
    return res


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


def observed_order(df: pd.DataFrame, rank: int) -> tuple[sim.Action, ...]:
    """The compute actions ``rank`` ran in the timed steps, read from its timeline: its ``F``/``B``/``W`` events
    in the order they started (step after step). What the compute recorded as it ran, not the action list the
    runner was handed: an op that never ran, ran twice or out of turn shows up here."""
    comp = df[(df["rank"] == rank) & df["name"].isin(COMPUTE_OPS) & (df["step"] >= 0)]
    comp = comp.sort_values(["step", "start_ns"], kind="stable")
    return tuple(sim.Action(str(r.name), int(r.microbatch), int(r.stage)) for r in comp.itertuples())


def dependency_violations(df: pd.DataFrame, schedule: Schedule) -> list[str]:
    """Data dependencies the measured run broke, on the run's common clock (one host: CLOCK_MONOTONIC), per
    timed step: ``F`` of stage s, micro-batch j may start only after ``F(s-1, j)`` ended (its input activation);
    ``B(s, j)`` only after ``F(s, j)`` and, below the last stage, ``B(s+1, j)`` (its output gradient); ``W(s, j)``
    only after ``B(s, j)``. A missing producer is a violation too. Independent of the action lists: it reads
    when each op ran on which rank. Returns one line per violation (empty when the run respected them all)."""
    comp = df[df["name"].isin(COMPUTE_OPS) & (df["step"] >= 0)]
    ev = {(int(r.step), str(r.name), int(r.stage), int(r.microbatch)): (int(r.start_ns), int(r.end_ns))
          for r in comp.itertuples()}
    last = schedule.n_stages - 1
    bad = []
    for (step, op, s, j), (start, _end) in sorted(ev.items()):
        needs = []
        if op == "F" and s > 0:
            needs.append(("F", s - 1))
        elif op == "B":
            needs += [("F", s)] + ([("B", s + 1)] if s < last else [])
        elif op == "W":
            needs.append(("B", s))
        for nop, ns in needs:
            prod = ev.get((step, nop, ns, j))
            if prod is None:
                bad.append(f"step {step}: {op}(stage {s}, mb {j}) ran but {nop}(stage {ns}, mb {j}) never did")
            elif prod[1] > start:
                bad.append(f"step {step}: {op}(stage {s}, mb {j}) started {(prod[1] - start) / 1e6:.3f} ms before "
                           f"{nop}(stage {ns}, mb {j}) ended")
    return bad


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
        grads: parameter name -> gradient of the last step (when asked); order: per rank, the compute actions
            it ran in the timed steps, read from its timeline (:func:`observed_order`, measured).
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

    def dependency_violations(self) -> list[str]:
        """:func:`dependency_violations` of this run's timeline (empty: every op ran after its inputs existed)."""
        return dependency_violations(self.timeline, self.schedule)

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
    ``label``). Every job is checked before the launch (:func:`labkit.theory.pipeline.check_job`: ValueError
    naming the fix); ``timeout_s`` bounds the
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
        ValueError: any bad argument, before launching (see :func:`labkit.theory.pipeline.check_job`), or
            ``impl="labkit"`` on NCCL.
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
        order=tuple(observed_order(df, r) for r in range(pp)), handles=tuple(o["handles"] for o in per_rank),
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

