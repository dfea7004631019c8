"""``torch.distributed.pipelining`` on the same stage modules as the hand-written runner.

:class:`TorchPipeline` wraps this rank's :class:`~.stage.StageModule` s in ``PipelineStage`` s and drives
them with torch's schedule of the same name: ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
or ``ScheduleInterleavedZeroBubble`` with one stage per rank for ZB-H1 (which torch calls ZB1P). Its
per-micro-batch calls (``forward_one_chunk`` / ``backward_one_chunk`` / ``backward_weight_one_chunk``) are
timed into the rank's timeline as ``F`` / ``B`` / ``W`` events, so torch's action order is observed, not
assumed. :func:`torch_pipeline_order` reads the order torch plans from its schedule IR, without a process
group (an independent check of :func:`labkit.theory.simulate.make_schedule`).
"""

from __future__ import annotations

import types

import torch

from labkit.parallel.pipeline.p2p import P2P
from labkit.parallel.pipeline.stage import sync_tied_grads
from labkit.theory import simulate as sim
from labkit.theory.simulate import Action, Schedule

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zb-h1": "ScheduleInterleavedZeroBubble"}


class TorchPipeline:
    """torch's pipelining runtime on this rank's ``stages`` (global index -> StageModule) for ``schedule``.

    ``micro_batch_size`` and ``seq_len`` shape the example inputs torch needs to build its p2p buffers
    (tokens [b, T] on stage 0, hidden [b, T, H] elsewhere); ``loss_fn(logits, targets)`` is one micro-batch's
    mean loss (torch averages over micro-batches). ``ctx``: a RankContext (``rank``, ``device``, ``timeline``,
    ``now_ns()``). Every per-micro-batch call torch makes is a timeline span (``F``/``B``/``W``), so the order
    torch ran them in is read from the timeline (:func:`labkit.experiments.pipeline.observed_order`).
    """

    def __init__(self, ctx, schedule: Schedule, stages: dict, loss_fn, *, micro_batch_size: int, seq_len: int,
                 hidden_size: int, tied: bool = False):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import schedules as S

        self.ctx, self.schedule, self.stages, self.tied = ctx, schedule, stages, tied
        self.cur_step = -1
        mine = schedule.stages_of(ctx.rank)
        self.has_first, self.has_last = 0 in mine, schedule.n_stages - 1 in mine
        pstages = []
        for s in mine:
            example = (torch.zeros(micro_batch_size, seq_len, dtype=torch.long, device=ctx.device) if s == 0 else
                       torch.zeros(micro_batch_size, seq_len, hidden_size, device=ctx.device))  # [b, T] / [b, T, H]
            st = PipelineStage(stages[s], s, schedule.n_stages, ctx.device, input_args=(example,))
            self._instrument(st, s)
            pstages.append(st)
        cls = getattr(S, TORCH_SCHEDULES[schedule.name])
        multi = schedule.v > 1 or schedule.name == "zb-h1"  # torch's multi-stage schedule classes take a list
        self.runtime = cls(pstages if multi else pstages[0], n_microbatches=schedule.m,
                           loss_fn=lambda out, tgt: loss_fn(out, tgt))

    def _instrument(self, st, stage: int) -> None:
        """Time torch's per-micro-batch calls into the timeline (the order they ran in is the spans' order)."""
        ctx = self.ctx

        def wrap(name: str, attr: str, op: str):
            orig = getattr(st, attr, None)
            if orig is None:
                return

            def timed(*args, **kwargs):
                mbi = args[0] if args else kwargs.get(name)
                with ctx.timeline.span(op, "compute", step=self.cur_step, microbatch=int(mbi), stage=stage):
                    return orig(*args, **kwargs)

            setattr(st, attr, timed)

        wrap("fwd_chunk_id", "forward_one_chunk", "F")
        wrap("bwd_chunk_id", "backward_one_chunk", "B")
        wrap("bwd_chunk_id", "backward_weight_one_chunk", "W")

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, step: int = -1) -> float | None:
        """One training step on the batch tokens / targets [B, T] (torch splits it into m micro-batches [b, T]);
        then the tied embedding's gradients summed. Returns the step's mean loss on the last stage's rank,
        else None."""
        self.cur_step = step
        out_losses: list = []
        args = (tokens.to(self.ctx.device),) if self.has_first else ()
        kw = {"target": targets.to(self.ctx.device), "losses": out_losses} if self.has_last else {}
        self.runtime.step(*args, **kw)
        sync_tied_grads(self.ctx, self.schedule, self.stages, P2P(self.ctx), {"step": step}, self.tied)
        return float(sum(float(x.detach()) for x in out_losses) / self.schedule.m) if self.has_last else None


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
