"""Shared helpers for distributed training runs inside a rank: batch sharding, a step loop that records
timeline events and communication, tokens/s, full-state gathering and parity checks.

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
  :class:`~labkit.commlog.CommLog` saw (S in the nccl-tests convention: the buffer each call was given);
* ``ring_bytes_per_step`` — *model*: each logged S times its ring factor (all-reduce 2(n-1)/n, all-gather /
  reduce-scatter (n-1)/n): what a bandwidth-optimal ring would send per rank for those calls. It equals a
  prediction whenever the code issued the predicted calls, so it checks the calls, not the wire;
* ``socket_bytes_per_step`` — *measured (what left the process)*: the growth of ``wchar`` in /proc/self/io
  over the timed steps (:func:`labkit.collectives.socket_bytes_written`): gloo's TCP sends, plus the few
  bytes the rank writes otherwise. None where it cannot be read (NCCL, not Linux).

How the timeline is recorded (so that :func:`labkit.timeline.exposed_ns` means what it says):

* compute spans ``F`` (forward + loss), ``B`` (backward, from its start to the moment the last parameter
  gradient was accumulated, when that can be observed) and ``optimizer``, tagged with step and micro-batch;
* every *blocking* collective issued through ``torch.distributed`` is recorded as a ``comm`` event by a
  :class:`~labkit.commlog.CommLog`, and cut out of any compute span it falls in (the rank's thread was
  waiting, not computing);
* asynchronous collectives are recorded from issue to completion by :func:`track_async` (the wrapper calls
  it), and may overlap compute: that overlap is the hidden communication.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import pandas as pd
import torch
import torch.distributed as dist
import torch.nn as nn

from labkit.checks import check_divides, positive_int
from labkit.collectives import socket_bytes_written
from labkit.commlog import CommLog
from labkit.measure import model_state_bytes
from labkit.models import TOLERANCES, lm_loss, shard
from labkit.timeline import now_ns


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
    steps after warm-up: the loop holds a :class:`~labkit.commlog.CommLog` and records timeline events
    (module docstring) when ``record``.

    Returns a dict (plain data):
      ``losses`` — global mean loss per step (all steps, warm-up included), equal on every rank;
      ``step_s`` — measured seconds per timed step on this rank; ``tokens_per_s`` — global tokens per
      second from the median step (``global_batch_size * seq_len / median(step_s)``);
      ``comm`` — one dict per collective issued in the timed steps (op, nbytes S, bytes_per_rank, async_op);
      ``payload_bytes_per_step`` — measured: sum of S over the timed steps / steps (what the code issued);
      ``ring_bytes_per_step`` — model: sum of S x ring factor (``bytes_per_rank``) / steps;
      ``socket_bytes_per_step`` — measured: bytes this process wrote during the timed steps / steps
      (gloo's socket sends, :func:`labkit.collectives.socket_bytes_written`), None on CUDA or without
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


# ------------------------------------------------------------------------------------------------------
# state and parity
# ------------------------------------------------------------------------------------------------------
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights as CPU tensors keyed like the unwrapped model's ``state_dict``.

    Uses ``model.full_state_dict()`` when the wrapper has one; DTensor entries (FSDP2) are gathered with
    ``full_tensor()`` (a collective: every rank must call this). Non-persistent buffers are not included.
    """
    if hasattr(model, "full_state_dict"):
        return model.full_state_dict()
    out = {}
    for k, v in _unwrap(model).state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().cpu().clone()
    return out


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| over the entries of two state dicts with the same keys (KeyError otherwise)."""
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b)


def assert_state_close(actual: dict, expected: dict, dtype: torch.dtype = torch.float32, what: str = "") -> None:
    """``torch.testing.assert_close`` per entry with :data:`labkit.models.TOLERANCES` [dtype]; the error names
    the entry and ``what``. Raises AssertionError (mismatch) or KeyError (missing entry)."""
    tol = TOLERANCES[dtype]
    if set(actual) != set(expected):
        raise AssertionError(f"{what}: keys differ: {sorted(set(actual) ^ set(expected))}")
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], **tol, msg=lambda m, k=k: f"{what} {k}: {m}")


def assert_ranks_identical(states: list[dict], what: str = "") -> None:
    """Every rank's tensors equal rank 0's exactly (data-parallel replicas must not drift).
    Raises AssertionError naming the rank, the entry and the largest difference."""
    for r, sd in enumerate(states[1:], start=1):
        for k, v in states[0].items():
            if not torch.equal(sd[k], v):
                diff = float((sd[k].float() - v.float()).abs().max())
                raise AssertionError(f"{what}: rank {r} differs from rank 0 in {k} (max |diff| = {diff:.3g})")


def optimizer_step_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's ``step`` counters (AdamW keeps one float32 scalar per parameter tensor it
    owns), the part of ``labkit.measure.model_state_bytes``'s ``optimizer`` that does not scale with Ψ."""
    return sum(v.numel() * v.element_size() for st in optimizer.state.values() for k, v in st.items()
               if k == "step" and isinstance(v, torch.Tensor))


# ------------------------------------------------------------------------------------------------------
# several variants in one launch
# ------------------------------------------------------------------------------------------------------
#: keys of a run dict that configure the loop; every other key is passed to the wrapper builder
LOOP_KEYS = ("variant", "label", "steps", "warmup_steps", "global_batch_size", "n_microbatches",
             "sync_microbatch", "record")


def run_experiments(ctx, wrappers: dict[str, Callable], runs: list[dict], *, model: str = "lab-tiny-llama",
                    steps: int = 3, warmup_steps: int = 0, global_batch_size: int = 8, seq_len: int = 32,
                    n_microbatches: int = 1, lr: float = 1e-3, seed: int = 0, data_seed: int = 0,
                    return_state: bool = True, record: bool = True, **wrap_options) -> list[dict]:
    """Inside a rank: train several variants one after the other, each from the same fresh weights
    (``build_model(model, seed)``) on the same data (``SyntheticLM(vocab_size, seq_len, data_seed)``).

    ``wrappers`` maps a variant name to a builder ``fn(module, ctx, lr=..., **options) -> (wrapped,
    optimizer)``. ``runs`` is a list of dicts: ``variant`` (a key of ``wrappers``), optional ``label``, any
    of :data:`LOOP_KEYS` overriding the keyword defaults, and builder options (overriding ``wrap_options``).

    Returns one dict per run (same order): ``variant``, ``label``, ``losses``, ``step_s``, ``tokens_per_s``,
    ``payload_bytes_per_step`` (measured), ``ring_bytes_per_step`` (model), ``socket_bytes_per_step``
    (measured, gloo) as :func:`train_steps`, and ``comm`` (per op: calls, nbytes, bytes_per_rank, each per
    timed step),
    ``memory`` (``labkit.measure.model_state_bytes`` after the last step: parameters, gradients, optimizer
    with its step counters), ``optimizer_steps`` (:func:`optimizer_step_bytes`), ``grads`` (last step,
    before the update; full gradients only), ``state`` (:func:`full_state_dict`, when ``return_state``),
    ``window_ns`` (start, end) of the run on the launch's common clock (slice ``LaunchResult.timeline``
    with :func:`window`).
    Raises ValueError for an unknown variant (naming the valid ones) or bad sizes.
    """
    from labkit.checks import check_choice
    from labkit.models import SyntheticLM, build_model
    from labkit.spec import get_spec

    spec = get_spec(model)
    data = SyntheticLM(spec.vocab_size, seq_len, data_seed)
    out = []
    for run in runs:
        check_choice("variant", run.get("variant"), list(wrappers))
        loop = {"steps": steps, "warmup_steps": warmup_steps, "global_batch_size": global_batch_size,
                "n_microbatches": n_microbatches, "sync_microbatch": None, "record": record}
        loop.update({k: v for k, v in run.items() if k in LOOP_KEYS and k not in ("variant", "label")})
        options = {**wrap_options, **{k: v for k, v in run.items() if k not in LOOP_KEYS}}
        ctx.barrier()
        t0 = now_ns()
        module = build_model(spec, seed, device=ctx.device)
        named = list(module.named_parameters())
        wrapped, optimizer = wrappers[run["variant"]](module, ctx, lr=lr, **options)
        res = train_steps(ctx, wrapped, optimizer, data, grad_params=named, **loop)
        res["memory"] = model_state_bytes(wrapped, optimizer)
        res["optimizer_steps"] = optimizer_step_bytes(optimizer)
        if return_state:
            res["state"] = full_state_dict(wrapped)
        n = loop["steps"]
        summary: dict[str, dict] = {}
        for r in res.pop("comm"):
            s = summary.setdefault(r["op"], {"calls": 0, "nbytes": 0, "bytes_per_rank": 0.0})
            s["calls"] += 1 / n
            s["nbytes"] += r["nbytes"] / n
            s["bytes_per_rank"] += r["bytes_per_rank"] / n
        res["comm"] = summary
        res.update(variant=run["variant"], label=run.get("label", run["variant"]),
                   n_microbatches=loop["n_microbatches"])
        if hasattr(wrapped, "close"):
            wrapped.close()
        del wrapped, optimizer, module
        ctx.barrier()
        res["window_ns"] = (t0 - ctx.clock_offset_ns, now_ns() - ctx.clock_offset_ns)
        out.append(res)
    return out


def window(df, window_ns: tuple[int, int]):
    """The rows of a timeline frame inside ``window_ns`` = (start, end) (a run's ``window_ns``)."""
    lo, hi = window_ns
    return df[(df["start_ns"] >= lo) & (df["end_ns"] <= hi)]


def _runs(results) -> list[list[dict]]:
    """Per rank, the list of run dicts (a rank may return the list itself or a dict with a ``runs`` entry)."""
    return [r["runs"] if isinstance(r, dict) else r for r in results]


#: column names of :func:`summarize` (and the chapters' tables): each says where its number comes from
PAYLOAD = "logged payload S per step (measured: what the code issued)"
RING = "ring bytes per rank per step (model: S x factor)"
SOCKET = "socket bytes written per rank per step (measured: gloo)"


def summarize(results) -> pd.DataFrame:
    """One row per run of a launch of :func:`run_experiments` (``results``: the LaunchResult, one list of run
    dicts per rank, or one dict with a ``runs`` list per rank): ``label``, ``tokens_per_s`` (measured; the
    slowest rank's, since ranks step together), ``step_s`` (median over timed steps, slowest rank), per rank
    and step on rank 0: :data:`PAYLOAD` (measured: the S the code issued), :data:`RING` (model: S x ring
    factor), :data:`SOCKET` (measured: bytes written to gloo's sockets; NaN where not measurable),
    ``final_loss``, and measured model-state bytes on rank 0 (``parameters``, ``gradients``, ``optimizer``,
    ``model_states``)."""
    results = _runs(results)
    rows = []
    for i, r0 in enumerate(results[0]):
        per_rank = [results[k][i] for k in range(len(results))]
        mem = r0["memory"]
        rows.append({"label": r0["label"], "variant": r0["variant"],
                     "tokens_per_s": min(r["tokens_per_s"] for r in per_rank),
                     "step_s": max(statistics.median(r["step_s"]) for r in per_rank),
                     PAYLOAD: r0["payload_bytes_per_step"], RING: r0["ring_bytes_per_step"],
                     SOCKET: float("nan") if r0["socket_bytes_per_step"] is None else r0["socket_bytes_per_step"],
                     "final_loss": r0["losses"][-1],
                     **mem, "model_states": sum(mem.values())})
    return pd.DataFrame(rows)


GLOO = "bytes per rank per step (model: gloo's algorithms, reduce-scatter sent as an all-reduce)"
#: per op, bytes one rank sends per byte of S with gloo's CPU algorithms: a ring all-reduce and all-gather,
#: and a reduce-scatter that runs a whole all-reduce and keeps its shard (chapter 02 measures this)
GLOO_FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
                "reduce_scatter": lambda n: 2 * (n - 1) / n}


def wire_table(results) -> pd.DataFrame:
    """Per run of a :func:`run_experiments` launch (``results``: the LaunchResult), bytes one rank sends per
    step three ways, each labelled with its source: :data:`RING` (model: the logged S x ring factor),
    :data:`GLOO` (model: the logged S x :data:`GLOO_FACTORS`, the algorithms gloo runs on CPU) and
    :data:`SOCKET` (measured on rank 0: what the process wrote, /proc/self/io; NaN where not measurable), and
    ``measured / gloo model``. The group size is the launch's world size (every run here uses the world).
    Raises ValueError for a collective without a gloo factor."""
    runs = _runs(results)
    n = len(runs)
    rows = []
    for r0 in runs[0]:
        gloo = 0.0
        for op, c in r0["comm"].items():
            if op not in GLOO_FACTORS:
                raise ValueError(f"op={op!r} has no gloo model; valid: {', '.join(GLOO_FACTORS)}")
            gloo += c["nbytes"] * GLOO_FACTORS[op](n)
        sock = r0["socket_bytes_per_step"]
        rows.append({"label": r0["label"], RING: r0["ring_bytes_per_step"], GLOO: gloo,
                     SOCKET: float("nan") if sock is None else sock,
                     "measured / gloo model": float("nan") if sock is None or gloo == 0 else sock / gloo})
    return pd.DataFrame(rows)


def throughput_rank(ctx, wrappers: dict[str, Callable], runs: list[dict], *, model: str = "lab-small-llama",
                    steps: int = 3, repeats: int = 3, warmup_steps: int = 1, global_batch_size: int = 8,
                    seq_len: int = 128, lr: float = 1e-3, seed: int = 0, data_seed: int = 0,
                    **wrap_options) -> dict[str, list[float]]:
    """Rank function for fair speed comparisons: build every run's wrapped model once (same weights, same
    data), warm each up, then time ``steps`` steps of each in turn, ``repeats`` rounds (interleaving spreads
    machine noise over all variants alike). No timeline events; communication is not logged.

    ``runs``: dicts with ``variant`` (a key of ``wrappers``), optional ``label`` and builder options.
    Returns {label: [measured global tokens/s of each round]} (this rank's clock; ranks step together).
    Raises ValueError for an unknown variant or model, or non-positive steps / repeats / batch sizes.
    """
    from labkit.checks import check_choice
    from labkit.models import SyntheticLM, build_model
    from labkit.spec import get_spec

    spec = get_spec(model)
    data = SyntheticLM(spec.vocab_size, seq_len, data_seed)
    built = []
    for run in runs:
        check_choice("variant", run.get("variant"), list(wrappers))
        options = {**wrap_options, **{k: v for k, v in run.items() if k not in ("variant", "label")}}
        module = build_model(spec, seed, device=ctx.device)
        wrapped, opt = wrappers[run["variant"]](module, ctx, lr=lr, **options)
        label = run.get("label", run["variant"])
        train_steps(ctx, wrapped, opt, data, steps=1, warmup_steps=warmup_steps, global_batch_size=global_batch_size,
                    record=False)
        built.append((label, wrapped, opt))
    out: dict[str, list[float]] = {label: [] for label, _, _ in built}
    for _ in range(positive_int("repeats", repeats)):
        for label, wrapped, opt in built:
            r = train_steps(ctx, wrapped, opt, data, steps=steps, global_batch_size=global_batch_size, record=False)
            out[label].append(global_batch_size * seq_len * steps / sum(r["step_s"]))
    for _, wrapped, _ in built:
        if hasattr(wrapped, "close"):
            wrapped.close()
    return out


def exposure_table(results) -> pd.DataFrame:
    """Per run of a :func:`run_experiments` launch (``results``: the LaunchResult): measured communication
    time on the timeline, the part hidden behind compute, and the exposed rest
    (:func:`labkit.timeline.exposed_ns`), in ms per timed step, averaged over ranks."""
    from labkit.timeline import exposed_ns

    rows = []
    for r0 in _runs(results)[0]:
        df = window(results.timeline, r0["window_ns"])
        steps = len(r0["step_s"])
        if not len(df[df["kind"] == "comm"]):
            rows.append({"label": r0["label"], "comm_ms": 0.0, "hidden_ms": 0.0, "exposed_ms": 0.0,
                         "hidden_fraction": 0.0})
            continue
        e = exposed_ns(df).mean()
        rows.append({"label": r0["label"], "comm_ms": e["total_ns"] / 1e6 / steps,
                     "hidden_ms": e["hidden_ns"] / 1e6 / steps, "exposed_ms": e["exposed_ns"] / 1e6 / steps,
                     "hidden_fraction": float(e["hidden_fraction"])})
    return pd.DataFrame(rows)


def per_rank(results, label: str) -> list[dict]:
    """Every rank's run dict for the run called ``label`` (KeyError naming the labels if there is none)."""
    runs = _runs(results)
    labels = [r["label"] for r in runs[0]]
    if label not in labels:
        raise KeyError(f"no run labelled {label!r}; runs: {', '.join(labels)}")
    i = labels.index(label)
    return [rr[i] for rr in runs]


def replica_spread(results, what: str = "grads") -> pd.Series:
    """Per run label, the largest |difference| between any rank's ``what`` (``grads`` at the last step, or
    ``state``) and rank 0's: 0.0 when the replicas agree exactly (as data parallelism requires)."""
    runs = _runs(results)
    out = {}
    for i, r0 in enumerate(runs[0]):
        ref = r0.get(what) or {}
        out[r0["label"]] = max((max_abs_diff(rr[i][what], ref) for rr in runs[1:] if ref), default=0.0)
    return pd.Series(out, name=f"max |{what} - rank 0 {what}|")


# ------------------------------------------------------------------------------------------------------
# chapter helpers: validation before a launch, exercises, benchmark verdicts
# ------------------------------------------------------------------------------------------------------
def check_world_size(chapter: str, world_size, *, minimum: int = 2, why: str = "") -> int:
    """Return ``world_size`` as int; ValueError "chapter NN needs world_size >= minimum ..." (with ``why``)
    when it is smaller or not a positive integer."""
    n = positive_int("world_size", world_size)
    if n < minimum:
        raise ValueError(f"chapter {chapter} needs world_size >= {minimum}, got world_size={n}"
                         + (f": {why}" if why else "") + f"; use world_size={minimum} or more")
    return n


def _available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_fits_in_memory(spec, world_size: int, *, copies: int = 2, what: str = "this run") -> None:
    """Raise ValueError (before any launch) when ``world_size`` ranks, each holding ``copies`` full fp32 copies
    of ``spec``'s model states (4 + 4 + 8 bytes per parameter: weights, gradients, AdamW moments), would need
    more than half of this machine's available memory (MemAvailable, /proc/meminfo; no check where it cannot
    be read). The message names the model, the bytes (GB = 1e9) and the lab's CPU-sized presets."""
    from labkit.spec import get_spec

    spec = get_spec(spec) if isinstance(spec, str) else spec
    need = 16 * spec.n_params() * positive_int("copies", copies) * positive_int("world_size", world_size)
    avail = _available_memory_bytes()
    if avail is not None and need > avail / 2:
        raise ValueError(f"model={spec.name!r} ({spec.n_params():.3g} parameters) needs about {need / 1e9:.1f} GB "
                         f"for {what} on {world_size} ranks (16 bytes per parameter x {copies} copies per rank), "
                         f"more than half of the {avail / 1e9:.1f} GB available; choose a CPU-sized preset: "
                         "lab-tiny-llama, lab-tiny-gpt, lab-small-llama")


def check_exercise(answer, reference: float, *, hint: str, wrong: str, rel_tol: float = 1e-6,
                   abs_tol: float = 0.0) -> None:
    """A chapter exercise's self-check, printed. ``answer`` None: prints "not attempted yet" and ``hint`` —
    never the reference (CI runs the chapters unattended, and a reader should not see the answer before
    trying). Otherwise checks that ``answer`` is within ``rel_tol`` (relative) or ``abs_tol`` (absolute) of
    ``reference`` and prints "correct". Raises AssertionError with ``wrong`` (a hint, not the answer) when it
    is not."""
    import math

    if answer is None:
        print(f"not attempted yet — hint: {hint}")
        return
    ok = math.isclose(float(answer), float(reference), rel_tol=rel_tol, abs_tol=abs_tol)
    assert ok, f"{answer!r} is not right: {wrong}"
    print("correct")


def ratio_verdict(name: str, ratios, goal: float, *, higher_is_better: bool) -> tuple[str, bool]:
    """One line for a benchmark's headline ratio, measured over several rounds: the median of ``ratios``,
    their spread (min and max), and whether the median meets ``goal`` (``>= goal`` when
    ``higher_is_better``, else ``<= goal``). Returns (line, met); a benchmark prints the line last and exits
    non-zero when not met. Raises ValueError for no ratio or a non-finite one."""
    import math

    vals = [float(r) for r in ratios]
    if not vals or not all(math.isfinite(v) for v in vals):
        raise ValueError(f"ratios={vals!r} must be one or more finite numbers")
    med = statistics.median(vals)
    met = med >= goal if higher_is_better else med <= goal
    rel = ">=" if higher_is_better else "<="
    line = (f"{name} = {med:.3f} (median of {len(vals)}; spread {min(vals):.3f} to {max(vals):.3f}; measured) "
            f"goal {rel} {goal:.2f}: {'met' if met else 'NOT met'}")
    return line, met
