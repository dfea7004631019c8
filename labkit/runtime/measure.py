"""Measured memory of a live run, per rank, by the same categories labkit.theory.memory predicts.

* :func:`model_state_bytes` — bytes of parameters, gradients and optimizer state held by this rank, read from
  the live tensors. A sharded tensor (a ``DTensor``, as FSDP2 ``fully_shard`` and tensor parallelism make)
  counts only its local shard; a tensor reachable twice (tied weights) counts once.
* :class:`SavedActivations` — what autograd keeps for backward, per layer, through
  ``torch.autograd.graph.saved_tensors_hooks``. Counted by storage: the bytes of each distinct storage a
  saved tensor lives in, once, attributed to the first layer that saves it (a tensor saved twice — the
  norm output saved by wq, wk and wv; a view of the softmax output saved by the next matmul — shares one
  storage; it is the storage that stays alive, so a small view of a large buffer counts the whole buffer).
  Parameters and buffers are excluded (the weights a linear layer saves are model state, not activations).
* :func:`cuda_memory` — ``torch.cuda.memory_allocated / max_memory_allocated / memory_reserved /
  max_memory_reserved`` on a GPU; None on CPU (there is no allocator peak to read there).
* :func:`measure_training_rank` — a rank function for :func:`labkit.launch`: one training step of the lab's
  model (optionally under DDP or FSDP2), returning measured bytes per category beside the prediction.
* :func:`check_training_run` — before such a launch: its parameters, and the host memory the ranks will need
  (predicted by labkit.theory.memory) against this machine's (:func:`host_memory_bytes`), so a model too big for the
  machine is refused up front instead of the ranks being killed by the kernel's OOM killer.

Every number here is *measured*; labkit.theory.memory's are *predicted*; the rank function returns both, labelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import torch
import torch.nn as nn

from labkit.checks import check_choice, positive_int
from labkit.runtime.probes import host_memory_bytes  # noqa: F401 - re-exported

WRAPS = ("none", "ddp", "fsdp2")


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local part of ``t``: a DTensor's shard on this rank, else ``t`` itself."""
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        return local
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t`` on this rank: numel x element size of its local shard (a DTensor counts its shard)."""
    loc = _local(t)
    return loc.numel() * loc.element_size()


def _storage_key(t: torch.Tensor):
    loc = _local(t)
    try:
        st = loc.untyped_storage()
        return (loc.device.type, loc.device.index, st.data_ptr()), st.nbytes()
    except (RuntimeError, NotImplementedError):  # tensors without a storage (e.g. some subclasses)
        return ("id", id(loc)), loc.numel() * loc.element_size()


def _region_key(t: torch.Tensor):
    """(device, first byte address, bytes) of the local part of ``t``: equal for a tensor reached twice (a tied
    weight), different for distinct views into one flat buffer (FSDP2 keeps sharded gradients that way)."""
    loc = _local(t)
    return loc.device.type, loc.device.index, loc.data_ptr(), loc.numel() * loc.element_size()


def _byte_range(t: torch.Tensor):
    """(storage key, first byte, end byte) of the local part of ``t`` inside its storage, clipped to the bytes the
    storage holds now (a storage freed with ``resize_(0)`` — an unsharded parameter between uses — holds none).
    Non-contiguous tensors are keyed by their own region, as before."""
    loc = _local(t)
    nb = loc.numel() * loc.element_size()
    try:
        st = loc.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return ("id", id(loc)), 0, nb
    if not loc.is_contiguous():
        return _region_key(loc), 0, nb
    start = loc.storage_offset() * loc.element_size()
    live = st.nbytes()
    return (loc.device.type, loc.device.index, st.data_ptr()), min(start, live), min(start + nb, live)


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Measured model states on this rank, bytes: ``parameters`` (every distinct parameter's local bytes),
    ``gradients`` (their ``.grad``, local), ``optimizer`` (every tensor in ``optimizer.state``: Adam's
    exp_avg, exp_avg_sq and the float32 ``step``; DTensor states count their local shard).

    Every byte of memory counts once: a tied weight counts once; tensors that are views into one flat buffer
    count the bytes they cover (the buffer's other bytes, e.g. padding, are not counted), overlapping views
    (a ZeRO shard that is a view of the flat parameters) once; a view into a freed storage counts 0."""
    covered: dict = {}
    out = {"parameters": 0, "gradients": 0, "optimizer": 0}

    def add(cat, t):
        key, lo, hi = _byte_range(t)
        spans = covered.setdefault(key, [])
        new = hi - lo
        for a, b in spans:  # subtract what is already counted (the spans are kept disjoint)
            new -= max(0, min(b, hi) - max(a, lo))
        if hi > lo:
            spans.append((lo, hi))
            merged = []
            for a, b in sorted(spans):
                if merged and a <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], b))
                else:
                    merged.append((a, b))
            covered[key] = merged
        out[cat] += new

    params = list(dict.fromkeys(model.parameters()))
    for p in params:
        add("parameters", p)
    for p in params:
        if p.grad is not None:
            add("gradients", p.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if torch.is_tensor(v):
                    add("optimizer", v)
    return out


@dataclass
class SavedTensor:
    """One tensor autograd saved: where (``label``), ``shape``, ``dtype``, ``storage_bytes``, and whether its
    storage was already counted (``duplicate``) or belongs to a parameter/buffer (``model_state``)."""

    label: str
    shape: tuple
    dtype: str
    storage_bytes: int
    duplicate: bool = False
    model_state: bool = False


@dataclass
class SavedActivations:
    """Context manager that records what autograd saves during a forward pass, per layer.

    ``layers``: the modules to attribute to (default ``model.layers``); tensors saved before the first layer
    are labelled ``first_stage`` (embedding), after the last one ``last_stage`` (final norm, head, loss),
    inside layer i ``layer<i>``. Use::

        with SavedActivations(model) as acts:
            loss = lm_loss(model(tokens), targets)
        acts.by_label, acts.per_layer, acts.total_bytes

    Dedupe rule: each distinct storage (device, data pointer) counts once, its full ``nbytes``, in the label
    that saved it first (saved tensors stay alive until backward, so an address cannot be reused by another
    saved tensor meanwhile). Exclusions: any ``nn.Parameter``, and the storages of the model's parameters and
    buffers as they are at entry, at the root's forward and at the current layer's forward (FSDP2 swaps in
    unsharded parameters just before a module's forward and frees them after it, so only the current
    module's addresses are excluded: a freed address may be reused by a later activation).
    """

    model: nn.Module
    layers: list | None = None
    keep_items: bool = True
    by_label: dict[str, int] = field(default_factory=dict)
    items: list[SavedTensor] = field(default_factory=list)

    def __post_init__(self):
        if self.layers is None:
            self.layers = list(getattr(self.model, "layers", []))
        self._label = "first_stage"
        self._seen: set = set()
        self._static: set = set()
        self._root: set = set()
        self._current: set = set()
        self._handles = []
        self._hooks_ctx = None

    # -- hooks ---------------------------------------------------------------------------------------
    @staticmethod
    def _keys(module: nn.Module) -> set:
        return {_storage_key(t)[0] for t in list(module.parameters()) + list(module.buffers())}

    def _pre(self, i):
        def hook(module, args):
            self._label = f"layer{i}"
            self._current = self._keys(module)

        return hook

    def _root_pre(self, module, args):
        self._root = self._keys(module)

    def _post(self, i):
        def hook(module, args, out):
            self._label = "last_stage" if i == len(self.layers) - 1 else f"between{i}"
            self._current = set()  # FSDP2 may free this layer's unsharded parameters now

        return hook

    def _pack(self, t: torch.Tensor):
        key, nb = _storage_key(t)
        state = isinstance(t, nn.Parameter) or key in self._static or key in self._root or key in self._current
        dup = key in self._seen
        if not state and not dup:
            self._seen.add(key)
            self.by_label[self._label] = self.by_label.get(self._label, 0) + nb
        if self.keep_items:
            self.items.append(SavedTensor(self._label, tuple(t.shape), str(t.dtype).replace("torch.", ""), nb,
                                          dup, state))
        return t

    def __enter__(self):
        self._static = self._keys(self.model)
        self._handles.append(self.model.register_forward_pre_hook(self._root_pre))
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._pre(i)))
            self._handles.append(layer.register_forward_hook(self._post(i)))
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks_ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks_ctx.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    # -- results -------------------------------------------------------------------------------------
    @property
    def per_layer(self) -> list[int]:
        """Bytes first saved inside each layer, in layer order."""
        return [self.by_label.get(f"layer{i}", 0) for i in range(len(self.layers))]

    @property
    def total_bytes(self) -> int:
        """Measured bytes of every distinct saved storage, all labels together."""
        return sum(self.by_label.values())

    def table(self):
        """The saved tensors as a pandas DataFrame (label, shape, dtype, storage_bytes, duplicate, model_state)."""
        return pd.DataFrame([vars(i) for i in self.items])


def cuda_memory(device=None) -> dict[str, int] | None:
    """Measured CUDA allocator counters for ``device`` in bytes (allocated, max_allocated, reserved,
    max_reserved), or None when CUDA is not available / the device is not a GPU."""
    if not torch.cuda.is_available():
        return None
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        return None
    return {"allocated": torch.cuda.memory_allocated(device), "max_allocated": torch.cuda.max_memory_allocated(device),
            "reserved": torch.cuda.memory_reserved(device), "max_reserved": torch.cuda.max_memory_reserved(device)}


def reset_cuda_peak(device=None) -> None:
    """``torch.cuda.reset_peak_memory_stats`` on a GPU; a no-op on CPU."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.reset_peak_memory_stats(device)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CALC_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
ATTENTIONS = ("sdpa", "eager")
#: resident memory of one rank process besides what labkit.theory.memory predicts (Python, torch, gloo, allocator
#: slack): an assumption, about what `import torch` plus a process group costs on Linux
RANK_OVERHEAD_BYTES = 512 * 2**20


def _train_config(spec, micro_batch_size: int, seq_len: int, attention: str, dtype: str, device_type: str):
    """The labkit.theory.memory TrainConfig of a :func:`measure_training_rank` run (fp32 or 16-bit torch AdamW)."""
    from labkit.theory import memory as mem

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
    from labkit.theory import memory as mem
    from labkit.theory.spec import get_spec, presets

    world_size = positive_int("world_size", world_size)
    spec = get_spec(model) if dropout is None else get_spec(model, dropout=dropout)
    micro_batch_size, seq_len = _check_run_args(spec, micro_batch_size, seq_len, wraps, attention, dtype)
    host = host_memory_bytes() if host_bytes is None else positive_int("host_bytes", host_bytes)

    def usable(s) -> bool:
        return not (exact_activations and s.is_moe)

    def per_rank(s) -> int:
        train = _train_config(s, micro_batch_size, min(seq_len, s.max_seq_len), attention, dtype, "cpu")
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
    from labkit.models import SyntheticLM, build_model, lm_loss, make_optimizer
    from labkit.theory import memory as mem
    from labkit.theory.spec import get_spec

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
        train = _train_config(spec, micro_batch_size, seq_len, attention, dtype, ctx.device.type)
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
