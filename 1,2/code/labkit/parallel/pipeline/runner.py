"""The hand-written pipeline runner: one rank executes its action list of a :class:`labkit.theory.simulate.Schedule`.

The schedule is plain data — ``schedule.actions[rank]``, the very lists :func:`labkit.theory.simulate.simulate`
runs — so the runner knows no schedule by name. Whether the list is GPipe (all F, then all B; Huang et al.
2019), 1F1B (PipeDream-Flush: a warm-up of forwards, then one forward / one backward in the steady state,
then a cool-down of backwards; Narayanan et al. 2021, Sec. 2.2.1), interleaved 1F1B (v model chunks per rank,
global stage s on rank s % p; Sec. 2.2.2) or ZB-H1 (the backward split into B, the input gradient, and W,
the weight gradient, W filling the bubbles; Qi et al. 2023, Sec. 3.1), one loop walks it:

* ``F`` of stage s, micro-batch j: wait for the activation of stage s-1 (stage 0: take micro-batch j of the
  tokens), run the stage, ``isend`` the output to the rank of stage s+1 (the last stage computes the loss).
* ``B``: wait for the output gradient from stage s+1 (the last stage starts from its loss), backward through
  the stage, ``isend`` the input gradient to the rank of stage s-1.
* ``W`` (ZB-H1 only): run the weight-gradient matmuls that B queued (:class:`~.stage.WeightGradStore`).

Every ``irecv`` of a step is posted up front, so a send never waits for its receiver to get there; every
handle is waited on (:class:`~.p2p.P2P`). This is gloo-only: gloo matches p2p by tag and completes it
asynchronously, NCCL's in-order p2p streams would serialise the early receives into a deadlock.

What an op computes is the runner's ``compute``: :class:`StageCompute` runs the lab's model cut into ``pp * v``
stages; :class:`StandInCompute` sleeps each op's configured duration (a stand-in that lets a schedule's shape be
studied with more ranks than cores: sleeping, not spinning, so ranks sharing a core do not slow each other).
Every op is a timeline event: ``F``/``B``/``W`` (kind compute), ``send``/``recv`` (kind comm), tagged with
step, micro-batch and global stage.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from labkit.models import shard
from labkit.parallel.pipeline.p2p import ACTIVATION, GRADIENT, P2P, tag
from labkit.parallel.pipeline.stage import WeightGradStore, defer_weight_grads, sync_tied_grads
from labkit.theory.simulate import Action, Schedule


class ScheduleRunner:
    """Runs this rank's ``schedule.actions[ctx.rank]`` once per :meth:`step`, with ``compute`` doing the ops.

    ``ctx``: anything with ``rank``, ``timeline`` and ``now_ns()`` (a RankContext). After each step:
    ``peak_inflight`` (most (stage, micro-batch) activation sets held at once, over all steps),
    ``p2p.created`` / ``p2p.waited`` (handles). What ran, and in which order, is what the compute recorded on
    the timeline (its ``F``/``B``/``W`` spans; :func:`labkit.experiments.pipeline.observed_order`), not the
    list this runner walks.
    """

    def __init__(self, ctx, schedule: Schedule, compute):
        self.ctx, self.schedule, self.compute = ctx, schedule, compute
        self.actions = schedule.actions[ctx.rank]
        self.last_op = schedule.last_backward_op()  # after it a (stage, micro-batch) holds nothing: W in ZB-H1, else B
        self.p2p = P2P(ctx)
        self.peak_inflight = 0

    def _post_receives(self) -> dict[tuple[str, int, int], tuple]:
        """An irecv for every activation and gradient this rank's actions consume this step."""
        s, m, c = self.schedule, self.schedule.m, self.compute
        recvs = {}  # buffers [b, T, H] (stand-ins: [nbytes / 4])
        for a in self.actions:
            if a.op == "F" and a.stage > 0:  # activation from stage - 1
                buf = torch.empty(c.act_shape, dtype=c.act_dtype, device=c.device)  # [b, T, H]
                work = self.p2p.irecv(buf, s.rank_of(a.stage - 1), tag(ACTIVATION, a.stage, a.microbatch, m))
                recvs[("F", a.stage, a.microbatch)] = (work, buf)
            elif a.op == "B" and a.stage < s.n_stages - 1:  # gradient from stage + 1
                buf = torch.empty(c.act_shape, dtype=c.act_dtype, device=c.device)  # [b, T, H]
                work = self.p2p.irecv(buf, s.rank_of(a.stage + 1), tag(GRADIENT, a.stage + 1, a.microbatch, m))
                recvs[("B", a.stage, a.microbatch)] = (work, buf)
        return recvs

    def step(self, step: int = -1) -> None:
        """One training step: every action of this rank, then every send drained. ``step`` tags the events.
        Raises RuntimeError when the schedule leaves activations held or receives pending, or a handle unwaited."""
        s, m, p2p, rank = self.schedule, self.schedule.m, self.p2p, self.ctx.rank
        recvs = self._post_receives()
        self.compute.prepare(self.actions)
        held: dict[tuple[int, int], tuple] = {}  # (stage, micro-batch) -> what its backward needs
        for a in self.actions:
            key = (a.stage, a.microbatch)
            tags = {"step": step, "microbatch": a.microbatch, "stage": a.stage}
            if a.op == "F":
                x = None  # stage 0 takes its micro-batch of tokens [b, T] from the compute
                if a.stage > 0:
                    work, x = recvs.pop(("F", *key))  # x: activation [b, T, H] of stage - 1
                    p2p.wait(work, x, **tags)
                held[key], y = self.compute.forward(a, x, tags)  # y: output [b, T, H]; None on the last stage
                if a.stage < s.n_stages - 1:
                    p2p.isend(y, s.rank_of(a.stage + 1), tag(ACTIVATION, a.stage + 1, a.microbatch, m), **tags)
                self.peak_inflight = max(self.peak_inflight, len(held))
            elif a.op == "B":
                g = None  # the last stage starts from its loss
                if a.stage < s.n_stages - 1:
                    work, g = recvs.pop(("B", *key))  # g: dL/d(output) [b, T, H] from stage + 1
                    p2p.wait(work, g, **tags)
                gx = self.compute.backward(a, held[key], g, tags)  # gx: dL/d(input) [b, T, H]
                if a.stage > 0:
                    p2p.isend(gx, s.rank_of(a.stage - 1), tag(GRADIENT, a.stage, a.microbatch, m), **tags)
                held[key] = ()  # the graph is freed; a split backward keeps only the queued W inputs
            else:  # W (ZB-H1): the weight gradients B deferred
                self.compute.weight(a, tags)
            if a.op == self.last_op:
                held.pop(key, None)
                self.compute.release(key)
        if held or recvs:
            raise RuntimeError(f"rank {rank}: step ended with activations held for {sorted(held)} or receives "
                               f"pending for {sorted(recvs)}; the schedule is incomplete")
        p2p.drain()
        p2p.check()
        self.compute.finish(p2p, {"step": step})


# ------------------------------------------------------------------------------------------------------
# what an op computes
# ------------------------------------------------------------------------------------------------------
class SavedBytes:
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


class StageCompute:
    """The ops of real stage modules (:class:`~.stage.StageModule`, this rank's ``stages`` by global index).

    Set the step's batch with :meth:`set_batch` (tokens and targets [B, T], B = m micro-batches of b);
    ``loss_fn(logits, targets)`` is the mean loss of one micro-batch, scaled by 1/m so the step's gradient is
    the full batch's mean. In a split-backward schedule (``schedule.split_backward``, ZB-H1) every nn.Linear
    queues its weight gradient for W. ``params``: this rank's parameters (left out of the saved-bytes count).
    After each step: ``loss`` (the step's mean loss, on the last stage's rank), ``peak_saved_bytes``
    (autograd's saved tensors of the held micro-batches, parameters excluded; in ZB-H1 counted until W, an
    upper bound, since B frees the graph and only the queued matmuls' inputs stay).
    """

    def __init__(self, ctx, schedule: Schedule, stages: dict, loss_fn, *, act_shape: tuple, act_dtype,
                 params: Sequence[torch.Tensor], tied: bool = False):
        self.ctx, self.schedule, self.stages, self.loss_fn = ctx, schedule, stages, loss_fn
        self.act_shape, self.act_dtype, self.device = act_shape, act_dtype, ctx.device  # [b, T, H]
        self.params, self.tied = list(params), tied
        self.store = WeightGradStore()
        if schedule.split_backward:
            for st in stages.values():
                defer_weight_grads(st, self.store)
        self.tokens = self.targets = None
        self.loss = 0.0
        self.saved: dict[tuple[int, int], int] = {}
        self.cur_bytes = self.peak_saved_bytes = 0

    def set_batch(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        self.tokens, self.targets, self.loss = tokens, targets, 0.0  # [B, T] int64 each

    def prepare(self, actions) -> None:
        pass

    def forward(self, a: Action, x, tags: dict):
        m, last = self.schedule.m, a.stage == self.schedule.n_stages - 1
        # stage 0: micro-batch j of the tokens [b, T]; later stages: the received activation [b, T, H]
        x = shard(self.tokens, a.microbatch, m) if a.stage == 0 else x.requires_grad_(True)
        counter = SavedBytes(self.params)
        with self.ctx.timeline.span("F", "compute", **tags):
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
                y = self.stages[a.stage](x)  # [b, T, H]; logits [b, T, V] on the last stage
                if last:
                    y = self.loss_fn(y, shard(self.targets, a.microbatch, m)) / m  # scalar: 1/m of the step's loss
        self.saved[(a.stage, a.microbatch)] = counter.nbytes
        self.cur_bytes += counter.nbytes
        self.peak_saved_bytes = max(self.peak_saved_bytes, self.cur_bytes)
        if last:
            self.loss += float(y.detach())
            return (x, y), None
        return (x, y), y.detach()  # send the activation [b, T, H], not its graph

    def backward(self, a: Action, held: tuple, g, tags: dict):
        x, y = held
        self.store.key = (a.stage, a.microbatch)
        with self.ctx.timeline.span("B", "compute", **tags):
            torch.autograd.backward(y, grad_tensors=g)  # g [b, T, H] (None: y is the loss)
        return x.grad if a.stage > 0 else None  # dL/dx [b, T, H]

    def weight(self, a: Action, tags: dict) -> None:
        with self.ctx.timeline.span("W", "compute", **tags):
            self.store.run((a.stage, a.microbatch))

    def release(self, key: tuple[int, int]) -> None:
        self.cur_bytes -= self.saved.pop(key, 0)

    def finish(self, p2p: P2P, tags: dict) -> None:
        """After the flush: sum the tied embedding's two gradients (:func:`~.stage.sync_tied_grads`)."""
        sync_tied_grads(self.ctx, self.schedule, self.stages, p2p, tags, self.tied)


class StandInCompute:
    """Fixed compute: each op sleeps ``op_seconds[action]``; messages are ``nbytes`` of float32 whose value
    says who sent them (stage, micro-batch, F or B), checked on receipt (RuntimeError if messages crossed)."""

    def __init__(self, ctx, op_seconds: dict, nbytes: int):
        self.ctx, self.dur = ctx, op_seconds
        self.act_shape, self.act_dtype, self.device = (nbytes // 4,), torch.float32, ctx.device
        self.msgs: dict[Action, torch.Tensor] = {}

    @staticmethod
    def code(stage: int, microbatch: int, kind: float) -> float:
        return stage * 1000.0 + microbatch + kind

    def _expect(self, buf: torch.Tensor, stage: int, microbatch: int, kind: float) -> None:
        want = self.code(stage, microbatch, kind)
        if float(buf[0]) != want or float(buf[-1]) != want:
            raise RuntimeError(f"rank {self.ctx.rank}: received {float(buf[0])} but expected the message of stage "
                               f"{stage}, micro-batch {microbatch} ({want}): p2p messages crossed")

    def prepare(self, actions) -> None:
        """The step's messages, made before the clock matters: value = who sent it."""
        self.msgs = {a: torch.full(self.act_shape, self.code(a.stage, a.microbatch, 0.0 if a.op == "F" else 0.5))
                     for a in actions if a.op in ("F", "B")}

    def forward(self, a: Action, x, tags: dict):
        if x is not None:
            self._expect(x, a.stage - 1, a.microbatch, 0.0)
        with self.ctx.timeline.span("F", "compute", **tags):
            time.sleep(self.dur[a])
        return (), self.msgs[a]

    def backward(self, a: Action, held: tuple, g, tags: dict):
        if g is not None:
            self._expect(g, a.stage + 1, a.microbatch, 0.5)
        with self.ctx.timeline.span("B", "compute", **tags):
            time.sleep(self.dur[a])
        return self.msgs[a]

    def weight(self, a: Action, tags: dict) -> None:
        with self.ctx.timeline.span("W", "compute", **tags):
            time.sleep(self.dur[a])

    def release(self, key) -> None:
        pass

    def finish(self, p2p: P2P, tags: dict) -> None:
        pass
