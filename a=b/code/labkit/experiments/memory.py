"""The training-memory experiment of chapter 01: one AdamW step of the lab's model on every rank, alone, under
DDP and under FSDP2, measured by category beside labkit.theory.memory's prediction for the same layout.

* :func:`check_training_run` — before such a launch: its parameters, and the host memory the ranks will need
  (predicted by labkit.theory.memory) against this machine's (:func:`labkit.runtime.probes.host_memory_bytes`),
  so a model too big for the machine is refused up front instead of the ranks being killed by the kernel's
  OOM killer.
* :func:`measure_training_rank` — a rank function for :func:`labkit.launch`: one training step (optionally
  under DDP or FSDP2), returning measured bytes per category (:mod:`labkit.runtime.measure`) beside the
  predicted ones (:func:`train_config` says which calculator settings describe the run).
* :func:`comparison_frame` — the launch's results as one long table, measured / predicted per category.
"""

from __future__ import annotations

import pandas as pd
import torch
import torch.nn as nn

from labkit.checks import check_choice, positive_int
from labkit.models import SyntheticLM, build_model, lm_loss, make_optimizer
from labkit.runtime.measure import SavedActivations, cuda_memory, model_state_bytes, reset_cuda_peak
from labkit.runtime.probes import host_memory_bytes
from labkit.theory import memory as mem
from labkit.theory.spec import get_spec, presets

WRAPS = ("none", "ddp", "fsdp2")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CALC_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
ATTENTIONS = ("sdpa", "eager")
#: resident memory of one rank process besides what labkit.theory.memory predicts (Python, torch, gloo, allocator
#: slack): an assumption, about what `import torch` plus a process group costs on Linux
RANK_OVERHEAD_BYTES = 512 * 2**20


def train_config(spec, micro_batch_size: int, seq_len: int, attention: str, dtype: str, device_type: str):
    """The labkit.theory.memory TrainConfig of a :func:`measure_training_rank` run (fp32 or 16-bit torch AdamW):
    convention ``torch-fp32`` / ``torch-bf16``, ``attention`` "sdpa" -> "flash", ``kernels`` = ``device_type``
    ("cpu" or "cuda"), activations in ``dtype`` (float32, bfloat16, float16), the model's dropout."""
    return mem.TrainConfig(micro_batch_size=micro_batch_size, seq_len=seq_len,
                           convention="torch-fp32" if dtype == "float32" else "torch-bf16",
                           attention="flash" if attention == "sdpa" else "eager", kernels=device_type,
                           act_dtype=_CALC_DTYPE[dtype], dropout=spec.dropout)


def _check_run_args(spec, micro_batch_size, seq_len, wraps, attention, dtype) -> tuple[int, int]:
    for w in wraps:
        check_choice("wrap", w, WRAPS)
    check_choice("attention", attention, ATTENTIONS)
    check_choice("dtype", dtype, _DTYPES)
    micro_batch_size = positive_int("micro_batch_size", micro_batch_size)
    seq_len = spec.check_seq_len(seq_len)
    return micro_batch_size, seq_len


def check_training_run(model: str, world_size: int, *, micro_batch_size: int = 2, seq_len: int = 64,
                       wraps: tuple[str, ...] = ("none",), attention: str = "sdpa", dtype: str = "float32",
                       dropout: float | None = None, host_bytes: int | None = None,
                       exact_activations: bool = False) -> dict:
    """Check a :func:`measure_training_rank` launch before starting it; returns what it will need.

    Validates the arguments as the rank function does (wraps, attention, dtype, micro_batch_size, seq_len <=
    the model's max_seq_len, world_size >= 1), then predicts the host memory: every rank first builds the
    whole model and trains it unsharded (the ``none`` reference; DDP adds its two gradient buckets), so one
    rank needs labkit.theory.memory's ZeRO-0 budget for this run (no headroom) + :data:`RANK_OVERHEAD_BYTES`, and
    ``world_size`` ranks on one machine need ``world_size`` times that.

    ``exact_activations``: also refuse models whose saved activations labkit.theory.memory only estimates (MoE
    layers: the lab's top_k·capacity scaling, not derived from a run), for callers that check activations to
    a few per cent.

    ``host_bytes``: the machine's memory (None -> :func:`host_memory_bytes`). Returns ``{"per_rank_bytes",
    "needed_bytes", "host_bytes", "world_size", "summary"}`` (bytes, predicted; host_bytes measured, None if
    unknown; summary: one labelled line to print).
    Raises ValueError for bad arguments, a MoE model with ``exact_activations``, or when ``needed_bytes``
    exceeds ``host_bytes``: the message gives both (GB = 1e9) and the presets that would fit.
    """
    world_size = positive_int("world_size", world_size)
    spec = get_spec(model) if dropout is None else get_spec(model, dropout=dropout)
    micro_batch_size, seq_len = _check_run_args(spec, micro_batch_size, seq_len, wraps, attention, dtype)
    host = host_memory_bytes() if host_bytes is None else positive_int("host_bytes", host_bytes)

    def usable(s) -> bool:
        return not (exact_activations and s.is_moe)

    def per_rank(s) -> int:
        train = train_config(s, micro_batch_size, min(seq_len, s.max_seq_len), attention, dtype, "cpu")
        dp = world_size if "ddp" in wraps else 1
        est = mem.train_memory(s, mem.ParallelConfig(dp=dp), train, headroom=0.0, workspace_bytes=0)
        return est.total_bytes + RANK_OVERHEAD_BYTES

    if not usable(spec):
        valid = [n for n, s in sorted(presets().items()) if usable(s) and (host is None or world_size * per_rank(s)
                                                                            <= host)]
        raise ValueError(f"model={model!r} has mixture-of-experts layers, whose saved activations the calculator only "
                         "estimates (not derived from a run), so a measured-equals-predicted check cannot hold; "
                         f"valid models here: {', '.join(valid)}")
    need = per_rank(spec)
    have = f"this machine {host / 1e9:.1f} GB (measured)" if host is not None else "this machine's memory unknown"
    out = {"per_rank_bytes": need, "needed_bytes": world_size * need, "host_bytes": host, "world_size": world_size,
           "summary": f"host memory for the launch: {world_size * need / 1e9:.2f} GB predicted ({world_size} ranks x "
                      f"{need / 1e9:.2f} GB), {have}; GB = 1e9 bytes"}
    if host is not None and world_size * need > host:
        fits = [n for n, s in sorted(presets().items()) if usable(s) and world_size * per_rank(s) <= host]
        raise ValueError(
            f"model={model!r} on world_size={world_size} ranks needs about {world_size * need / 1e9:.1f} GB of "
            f"host memory (predicted: {world_size} x {need / 1e9:.2f} GB per rank, labkit.theory.memory, no headroom) "
            f"but this machine has {host / 1e9:.1f} GB; valid models here: {', '.join(fits) or 'none'}")
    return out


def _wrap(model: nn.Module, wrap: str, ctx):
    """(what to run, the module whose layers SavedActivations hooks) for ``wrap``: ``ddp`` torch
    ``DistributedDataParallel``; ``fsdp2`` ``fully_shard`` on each layer, then the root, over the whole world;
    ``none`` the model itself."""
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        return DDP(model, device_ids=ids), model
    if wrap == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model
    return model, model


def measure_training_rank(ctx, model: str = "lab-tiny-llama", *, micro_batch_size: int = 2, seq_len: int = 64,
                          wraps: tuple[str, ...] = ("none",), attention: str = "sdpa", dtype: str = "float32",
                          dropout: float | None = None, seed: int = 0) -> list[dict]:
    """Rank function (``launch(measure_training_rank, world_size, ...)``): for each wrap in ``wraps`` — ``none``
    (this rank trains a full replica alone: the single-rank reference, or DP-replicated without
    communication), ``ddp`` (torch DDP: replicated, gradients all-reduced), ``fsdp2`` (torch ``fully_shard`` on
    every layer and the root: ZeRO-3) — build the lab's model, run one AdamW step on this rank's
    ``micro_batch_size`` sequences of ``seq_len`` tokens, and measure.

    Returns one dict per wrap: ``wrap``, ``rank``, ``world_size``, ``measured`` (bytes per category:
    parameters, gradients, optimizer after the step; activations saved during the forward),
    ``activations_per_layer`` (measured), ``activation_edges`` (measured: first_stage / last_stage),
    ``predicted`` (labkit.theory.memory's categories for the same layout: ZeRO 0 for none/ddp, 3 for fsdp2, over
    ``world_size`` ranks for ddp/fsdp2), ``predicted_per_layer``, ``cuda`` (allocator counters on a GPU, else
    None), ``loss``.

    FSDP2's shards follow ``torch.chunk`` on dim 0, so with a world size that does not divide a tensor's first
    dimension the ranks hold different bytes: the prediction is made per rank (``shard_layout="dim0"``,
    ``dp_rank=rank``). Call :func:`check_training_run` before launching.

    Raises ValueError for an unknown wrap, attention kind or dtype, or a seq_len beyond the model's.
    """
    spec = get_spec(model) if dropout is None else get_spec(model, dropout=dropout)
    micro_batch_size, seq_len = _check_run_args(spec, micro_batch_size, seq_len, wraps, attention, dtype)
    data = SyntheticLM(spec.vocab_size, seq_len, seed)
    tokens, targets = data.batch(0, micro_batch_size * ctx.world_size)
    sl = slice(ctx.rank * micro_batch_size, (ctx.rank + 1) * micro_batch_size)
    # clone: a slice would keep the whole global batch's storage alive (and be counted so)
    tokens, targets = tokens[sl].clone().to(ctx.device), targets[sl].clone().to(ctx.device)
    results = []
    for wrap in wraps:
        torch.manual_seed(seed)
        base = build_model(spec, seed, dtype=_DTYPES[dtype], device=ctx.device, attention=attention)
        base.train()
        runner, inner = _wrap(base, wrap, ctx)
        opt = make_optimizer(runner.parameters())
        reset_cuda_peak(ctx.device)
        with SavedActivations(inner, keep_items=False) as acts:
            loss = lm_loss(runner(tokens), targets)
        loss.backward()
        opt.step()
        ctx.sync()
        measured = model_state_bytes(runner, opt)
        measured["activations"] = acts.total_bytes
        n = ctx.world_size if wrap != "none" else 1
        par = mem.ParallelConfig(dp=n, zero=3 if wrap == "fsdp2" else 0,
                                 shard_layout="dim0" if wrap == "fsdp2" else "even")
        train = train_config(spec, micro_batch_size, seq_len, attention, dtype, ctx.device.type)
        pred = mem.train_memory(spec, par, train, headroom=0.0, workspace_bytes=0,
                                dp_rank=ctx.rank if wrap == "fsdp2" else 0)
        results.append({
            "wrap": wrap, "rank": ctx.rank, "world_size": ctx.world_size, "model": model, "dtype": dtype,
            "attention": attention, "micro_batch_size": micro_batch_size, "seq_len": seq_len,
            "measured": measured, "activations_per_layer": acts.per_layer,
            "activation_edges": {k: v for k, v in acts.by_label.items() if not k.startswith("layer")},
            "predicted": {k: v for k, v in pred.categories.items()},
            "predicted_per_layer": pred.details["activation_bytes_per_layer"],
            "cuda": cuda_memory(ctx.device), "loss": float(loss.detach()),
        })
        del runner, inner, base, opt, loss, acts
        if wrap != "none":
            ctx.barrier()
    return results


LAYOUT_NAMES = {"none": "1 rank, full replica (reference)", "ddp": "DDP (ZeRO-0, replicated)",
                "fsdp2": "FSDP2 fully_shard (ZeRO-3)"}


def comparison_frame(results) -> pd.DataFrame:
    """Long table of a :func:`measure_training_rank` launch: one row per (layout, rank, category) with
    ``measured_bytes``, ``predicted_bytes`` and ``measured_over_predicted``. ``results``: what launch returned
    (a list per rank of lists per wrap). Categories: parameters, gradients, optimizer, activations (the ones
    measured; temporary/communication buffers and allocator headroom are not visible on CPU)."""
    rows = []
    for per_rank in results:
        for r in per_rank:
            for cat in ("parameters", "gradients", "optimizer", "activations"):
                me, pr = r["measured"][cat], r["predicted"][cat]
                layout = LAYOUT_NAMES[r["wrap"]] + ("" if r["wrap"] == "none" else f", dp={r['world_size']}")
                rows.append({"layout": layout, "wrap": r["wrap"], "rank": r["rank"], "category": cat,
                             "measured_bytes": me, "predicted_bytes": pr,
                             "measured_over_predicted": me / pr if pr else float("nan")})
    return pd.DataFrame(rows)
