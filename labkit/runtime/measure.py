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
  max_memory_reserved`` on a GPU; None on CPU (there is no allocator peak to read there);
  :func:`reset_cuda_peak` before what is to be measured.
* :func:`host_memory_bytes` — this machine's memory (re-exported from :mod:`labkit.runtime.probes`).

Every number here is *measured*; labkit.theory.memory's are *predicted*. The rank function that measures a
training step and sets both side by side is :func:`labkit.experiments.memory.measure_training_rank`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import torch
import torch.nn as nn

from labkit.runtime.probes import host_memory_bytes  # noqa: F401 - re-exported


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

    # every registered parameter, also those a wrapper's parameters() leaves out (ZeroDataParallel yields its
    # shards, not the module's views into the full flat buffer, which still hold memory)
    params = list(dict.fromkeys(p for m in model.modules() for p in m._parameters.values() if p is not None))
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
