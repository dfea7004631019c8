"""The training-step loop every experiment shares, inside a rank: batch sharding, micro-batches, and a step
loop that records timeline events and communication and reports tokens/s.

Every strategy (data, ZeRO, tensor, pipeline, context parallel) can use :func:`train_steps` with a model
*wrapper* that follows a small duck-typed protocol; each method is optional:

``wrapper(tokens)``
    forward, logits [B, T, V] (any callable module).
``wrapper.no_sync()``
    context manager: a backward run inside it does not synchronise gradients (accumulate locally);
    absent or None when the wrapper synchronises every micro-batch (ZeRO-2/3, FSDP2).
    The loop uses it on every micro-batch except ``sync_microbatch`` (the last one, unless you are
    reproducing the accumulation bug).
``wrapper.finish_grad_sync()``
    called after *every* micro-batch's backward; the wrapper does its communication (or waits for the
    communication its hooks started) when that backward was not inside ``no_sync``.
``wrapper.after_optimizer_step()``
    called after ``optimizer.step()`` (ZeRO-1/2 all-gather the updated shards here).
``wrapper.full_state_dict()``
    the full, unsharded weights as CPU tensors keyed like the unwrapped model's ``state_dict``.

What a run reports about communication, and how each number was obtained:

* ``payload_bytes_per_step`` — *measured (what the code issued)*: the sum of S over the collectives the
  :class:`~labkit.runtime.commlog.CommLog` saw (S in the nccl-tests convention: the buffer each call was given);
* ``ring_bytes_per_step`` — *model*: each logged S times its ring factor (all-reduce 2(n-1)/n, all-gather /
  reduce-scatter (n-1)/n): what a bandwidth-optimal ring would send per rank for those calls. It equals a
  prediction whenever the code issued the predicted calls, so it checks the calls, not the wire;
* ``socket_bytes_per_step`` — *measured (what left the process)*: the growth of ``wchar`` in /proc/self/io
  over the timed steps (:func:`labkit.runtime.probes.socket_bytes_written`): gloo's TCP sends, plus the few
  bytes the rank writes otherwise. None where it cannot be read (NCCL, not Linux).

How the timeline is recorded (so that :func:`labkit.runtime.timeline.exposed_ns` means what it says):

* compute spans ``F`` (forward + loss), ``B`` (backward, from its start to the moment the last parameter
  gradient was accumulated, when that can be observed) and ``optimizer``, tagged with step and micro-batch;
* every *blocking* collective issued through ``torch.distributed`` is recorded as a ``comm`` event by a
  :class:`~labkit.runtime.commlog.CommLog`, and cut out of any compute span it falls in (the rank's thread was
  waiting, not computing);
* asynchronous collectives are recorded from issue to completion by :func:`track_async` (the wrapper calls
  it), and may overlap compute: that overlap is the hidden communication.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.checks import check_divides, positive_int
from labkit.models import lm_loss, shard
from labkit.runtime.commlog import CommLog
from labkit.runtime.probes import socket_bytes_written
from labkit.runtime.timeline import now_ns


# ------------------------------------------------------------------------------------------------------
# batches
# ------------------------------------------------------------------------------------------------------
def local_batch(data, step: int, global_batch_size: int, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's share of step ``step``'s global batch.

    ``data.batch(step, global_batch_size)`` must return the same (tokens, targets) [G, T] on every rank
    (:class:`labkit.models.SyntheticLM` does); rank ``dp_rank`` of ``dp`` keeps rows
    ``[dp_rank*G/dp, (dp_rank+1)*G/dp)``. Returns int64 tensors [G/dp, T].
    Raises ValueError if dp does not divide global_batch_size.
    """
    check_divides("dp", dp, "global_batch_size", global_batch_size)
    tokens, targets = data.batch(step, global_batch_size)
    return shard(tokens, dp_rank, dp), shard(targets, dp_rank, dp)


def microbatches(tokens: torch.Tensor, targets: torch.Tensor, n_microbatches: int) -> list[tuple]:
    """Split a local batch [b, T] into ``n_microbatches`` equal micro-batches [b/n, T] (in order).
    Raises ValueError if n_microbatches does not divide b."""
    check_divides("n_microbatches", n_microbatches, "local batch size", tokens.shape[0])
    return [(shard(tokens, i, n_microbatches), shard(targets, i, n_microbatches)) for i in range(n_microbatches)]


# ------------------------------------------------------------------------------------------------------
# timeline helpers
# ------------------------------------------------------------------------------------------------------
class _StepState:
    """Tags of the step / micro-batch the loop is in (read by track_async for its events)."""

    step: int = -1
    microbatch: int = -1


CURRENT = _StepState()


class Tracked:
    """An asynchronous collective whose completion goes onto the timeline; ``wait()`` like a Work."""

    def __init__(self, ctx, work, name: str, nbytes: int):
        self.work, self.ctx, self.name, self.nbytes = work, ctx, name, nbytes
        self.start, self.step, self.mb = now_ns(), CURRENT.step, CURRENT.microbatch
        self.recorded = False
        self.observed = False  # True when the completion time came from the work's future
        if ctx is not None:
            try:
                work.get_future().add_done_callback(lambda _f: self._record())
                self.observed = True
            except RuntimeError:  # gloo's reduce_scatter has no future: completion = when wait() returns
                pass

    def _record(self) -> None:
        if not self.recorded and self.ctx is not None:
            self.recorded = True
            self.ctx.timeline.add(self.name, "comm", self.start, max(self.start, now_ns()), step=self.step,
                                  microbatch=self.mb, nbytes=self.nbytes)

    def wait(self) -> None:
        self.work.wait()
        if not self.observed:
            self._record()


def track_async(ctx, work, name: str, nbytes: int = 0) -> Tracked:
    """Record an asynchronous collective on ``ctx.timeline`` as a ``comm`` event from now (its issue) to its
    completion, tagged with the current step and micro-batch. The completion time is observed through
    ``work.get_future()`` (a callback on the communication thread) where the backend provides one; else
    (gloo reduce-scatter) it is the moment ``wait()`` on the returned object returns, an upper bound.
    Returns a :class:`Tracked`; call its ``wait()`` instead of ``work.wait()``. ``ctx`` None: no events."""
    return Tracked(ctx, work, name, nbytes)


class GradClock:
    """The time (ns) the last parameter gradient was accumulated during the current backward.

    Uses ``Tensor.register_post_accumulate_grad_hook`` on plain-tensor parameters (DTensor parameters
    managed by FSDP2 get their gradients assigned, not accumulated, and are skipped). ``last_ns`` is None
    when no hook fired.
    """

    def __init__(self, params):
        self.last_ns: int | None = None
        self.handles = []
        for p in params:
            if p.requires_grad and type(p) in (torch.Tensor, nn.Parameter):
                self.handles.append(p.register_post_accumulate_grad_hook(self._hook))

    def _hook(self, _p):
        self.last_ns = now_ns()

    def reset(self):
        self.last_ns = None

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


def _carve(spans: list[tuple], blocking: list[tuple[int, int]]) -> list[tuple]:
    """Cut the blocking intervals out of the compute spans: (name, start, end, tags) -> pieces."""
    out = []
    blocking = sorted(blocking)
    for name, s, e, tags in spans:
        cur = s
        for bs, be in blocking:
            if be <= cur or bs >= e:
                continue
            if bs > cur:
                out.append((name, cur, bs, tags))
            cur = max(cur, be)
        if cur < e:
            out.append((name, cur, e, tags))
    return out


# ------------------------------------------------------------------------------------------------------
# the step loop
# ------------------------------------------------------------------------------------------------------
def train_steps(ctx, model, optimizer: torch.optim.Optimizer, data, *, steps: int, global_batch_size: int,
                dp_rank: int | None = None, dp: int | None = None, n_microbatches: int = 1,
                sync_microbatch: int | None = None, warmup_steps: int = 0, loss_fn: Callable = lm_loss,
                record: bool = True, grad_params=None, dp_group=None) -> dict:
    """Run ``warmup_steps + steps`` training steps of ``model`` (a wrapper, see the module docstring).

    Each step: this rank's share of the global batch (:func:`local_batch`), split into ``n_microbatches``;
    per micro-batch forward, ``loss / n_microbatches`` backward (so the update equals one step on the whole
    batch, as in :func:`labkit.models.train_reference`), ``finish_grad_sync``; then the optimizer step.
    Every micro-batch except ``sync_microbatch`` (default: the last) runs inside ``model.no_sync()`` when the
    wrapper has one; passing another index reproduces the accumulation bug (sync on the wrong micro-batch).

    ``dp_rank``/``dp`` default to this rank / the world size; ``dp_group`` (default: the world) is the group
    the losses are averaged over at the end. Timing and communication are measured over the ``steps``
    steps after warm-up: the loop holds a :class:`~labkit.runtime.commlog.CommLog` and records timeline events
    (module docstring) when ``record``.

    Returns a dict (plain data):
      ``losses`` — global mean loss per step (all steps, warm-up included), equal on every rank;
      ``step_s`` — measured seconds per timed step on this rank; ``tokens_per_s`` — global tokens per
      second from the median step (``global_batch_size * seq_len / median(step_s)``);
      ``comm`` — one dict per collective issued in the timed steps (op, nbytes S, bytes_per_rank, async_op);
      ``payload_bytes_per_step`` — measured: sum of S over the timed steps / steps (what the code issued);
      ``ring_bytes_per_step`` — model: sum of S x ring factor (``bytes_per_rank``) / steps;
      ``socket_bytes_per_step`` — measured: bytes this process wrote during the timed steps / steps
      (gloo's socket sends, :func:`labkit.runtime.probes.socket_bytes_written`), None on CUDA or without
      /proc/self/io (module docstring);
      ``grads`` — this rank's gradients at the last step before the update, by parameter name (only for
      wrappers whose gradients are full tensors on ``grad_params``).
    Raises ValueError for bad steps / batch arguments.
    """
    steps = positive_int("steps", steps)
    positive_int("warmup_steps", warmup_steps, minimum=0)
    dp = ctx.world_size if dp is None else dp
    dp_rank = ctx.rank if dp_rank is None else dp_rank
    if sync_microbatch is None:
        sync_microbatch = n_microbatches - 1
    if not 0 <= sync_microbatch < n_microbatches:
        raise ValueError(f"sync_microbatch={sync_microbatch} must be in 0..{n_microbatches - 1}")
    no_sync = getattr(model, "no_sync", None)
    finish = getattr(model, "finish_grad_sync", None)
    after_step = getattr(model, "after_optimizer_step", None)
    named = list(grad_params) if grad_params is not None else list(_unwrap(model).named_parameters())
    clock = GradClock([p for _, p in named])
    seq_len = None
    losses, step_s, spans = [], [], []
    log = CommLog(ctx if record else None)
    total = warmup_steps + steps
    written0 = written1 = None
    try:
        for step in range(total):
            timed = step >= warmup_steps
            if timed and step == warmup_steps:
                ctx.barrier()
                log.__enter__()
                written0 = None if ctx.device.type == "cuda" else socket_bytes_written()
            t_step = time.perf_counter()
            CURRENT.step = step
            tokens, targets = local_batch(data, step, global_batch_size, dp_rank, dp)
            tokens, targets = tokens.to(ctx.device), targets.to(ctx.device)
            seq_len = tokens.shape[1]
            optimizer.zero_grad(set_to_none=True)
            if hasattr(model, "zero_grad"):
                model.zero_grad(set_to_none=True)
            local = 0.0
            for mb, (tk, tg) in enumerate(microbatches(tokens, targets, n_microbatches)):
                CURRENT.microbatch = mb
                tags = {"step": step, "microbatch": mb}
                cm = no_sync() if (no_sync is not None and mb != sync_microbatch) else contextlib.nullcontext()
                with cm:
                    s = now_ns()
                    loss = loss_fn(model(tk), tg) / n_microbatches
                    e = now_ns()
                    spans.append(("F", s, e, tags))
                    clock.reset()
                    s = now_ns()
                    loss.backward()
                    e = now_ns()
                    spans.append(("B", s, clock.last_ns if clock.last_ns and clock.last_ns < e else e, tags))
                    if finish is not None:
                        finish()
                local += float(loss.detach())
            if step == total - 1:
                grads = {n: p.grad.detach().cpu().clone() for n, p in named
                         if p.grad is not None and type(p.grad) is torch.Tensor}
            CURRENT.microbatch = -1
            s = now_ns()
            optimizer.step()
            if after_step is not None:
                after_step()
            spans.append(("optimizer", s, now_ns(), {"step": step}))
            if timed:
                ctx.sync()
                step_s.append(time.perf_counter() - t_step)
            losses.append(local)
        written1 = socket_bytes_written() if written0 is not None else None
    finally:
        if log._saved:
            log.__exit__(None, None, None)
        clock.remove()
        CURRENT.step = CURRENT.microbatch = -1
    if record:
        timed_start = min((s for _n, s, _e, t in spans if t["step"] >= warmup_steps), default=0)
        blocking = [(r["start_ns"], r["end_ns"]) for r in log.records if not r["async_op"]]
        for name, s, e, tags in _carve([sp for sp in spans if sp[1] >= timed_start], blocking):
            ctx.timeline.add(name, "compute", s, e, **tags)
    # the global mean loss per step: one all-reduce after the timed region
    lt = torch.tensor(losses, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(lt, group=dp_group)
    comm = [{k: r[k] for k in ("op", "nbytes", "bytes_per_rank", "async_op", "tag")} for r in log.records]
    med = statistics.median(step_s)
    return {"losses": (lt / dp).tolist(),
            "step_s": step_s, "tokens_per_s": global_batch_size * seq_len / med,
            "comm": comm, "payload_bytes_per_step": sum(r["nbytes"] for r in comm) / steps,
            "ring_bytes_per_step": sum(r["bytes_per_rank"] for r in comm) / steps,
            "socket_bytes_per_step": None if written1 is None else (written1 - written0) / steps,
            "grads": grads}


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a wrapper (``.module`` for DDP and the lab's wrappers)."""
    return getattr(model, "module", model)
