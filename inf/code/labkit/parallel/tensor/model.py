"""The whole model, tensor- (and optionally sequence-) parallel: :func:`apply_tp` -> :class:`TPTransformer`
for the lab's :class:`~labkit.models.Transformer`, sharded from the full weights every rank built, so every
tp starts from the same function; :func:`finalize_grads` (the partial gradients summed) and
:func:`gather_full` (the full parameters or gradients rebuilt on every rank).

Shapes: B batch, T sequence, H hidden, tp the group size, Vp the padded vocabulary. Sequence parallelism:
Korthikanti et al. 2022, Section 4.2.2; the rest: Shoeybi et al. 2019, "Megatron-LM", Section 3.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from labkit.checks import check_choice, check_divides
from labkit.models import Transformer
from labkit.parallel.tensor.blocks import ParallelAttention, ParallelMLP
from labkit.parallel.tensor.layers import VocabParallelEmbedding, _even_info, _mark, vocab_parallel_cross_entropy
from labkit.parallel.tensor.primitives import (
    _all_gather_dim,
    _all_reduce,
    _split_dim,
    _tag,
    column_region,
    tp_rank,
    tp_size,
)
from labkit.theory.tensor import check_tp


class TPTransformer(nn.Module):
    """The lab's :class:`~labkit.models.Transformer` with tensor (and optionally sequence) parallelism.

    Same parameter names as the model it was built from (``embed.weight``, ``layers.0.attn.wq.weight``, ...),
    each holding this rank's block (see ``param._tp_shard`` / :class:`~labkit.parallel.tensor.layers.ShardInfo`).
    tokens [B, T] -> logits [B, T, Vp/tp] (this rank's vocabulary block, stamped ``shard(-1)``); :meth:`loss`
    is the vocab-parallel cross-entropy. With sequence parallelism the residual stream between blocks is
    [B, T/tp, H].

    ``commlog``: set to a :class:`~labkit.runtime.commlog.CommLog` (anything with ``tagged(tag)``, a context
    manager) to tag every collective with its place and phase (``embed/fwd``, ``layer3/fwd``, ``layer3/bwd``,
    ``head/bwd``...). Backward tags are set by gradient hooks on the block outputs, so the collectives of
    layer i's backward carry ``layer{i}/bwd``.
    """

    def __init__(self, model: Transformer, group=None, *, sequence_parallel: bool = False, pad_vocab: bool = False,
                 regather: bool = True):
        super().__init__()
        spec = model.spec
        n = tp_size(group)
        plan = check_tp(spec, n, pad_vocab=pad_vocab)
        self.spec, self.group, self.tp, self.plan = spec, group, n, plan
        self.sequence_parallel, self.regather = sequence_parallel, regather
        self.vocab_size, self.padded_vocab_size = spec.vocab_size, plan["padded_vocab_size"]
        mode = "sp" if sequence_parallel else "reduce"
        self.embed = VocabParallelEmbedding.from_embedding(model.embed, group, output_mode=mode,
                                                           padded_vocab_size=self.padded_vocab_size)
        self.pos_embed = model.pos_embed
        partial = sequence_parallel and n > 1
        if self.pos_embed is not None:
            _mark(self.pos_embed.weight, partial=partial)
        self.layers = model.layers
        for blk in self.layers:
            blk.attn = ParallelAttention(blk.attn, spec.n_heads, spec.n_kv_heads, group,
                                         sequence_parallel=sequence_parallel, regather=regather)
            blk.mlp = ParallelMLP(blk.mlp, group, sequence_parallel=sequence_parallel, regather=regather)
            for norm in (blk.attn_norm, blk.mlp_norm):
                for p in norm.parameters():
                    _mark(p, partial=partial)
        self.norm = model.norm
        for p in self.norm.parameters():
            _mark(p, partial=partial)
        if model.lm_head is not None:
            head = model.lm_head
            vp, k = self.padded_vocab_size, self.padded_vocab_size // n
            full = torch.zeros(vp, head.in_features, dtype=head.weight.dtype, device=head.weight.device)
            full[: spec.vocab_size] = head.weight.detach()
            self.lm_head = nn.Linear(head.in_features, k, bias=False, device=head.weight.device,
                                     dtype=head.weight.dtype)
            with torch.no_grad():
                self.lm_head.weight.copy_(full[tp_rank(group) * k:(tp_rank(group) + 1) * k])
            _mark(self.lm_head.weight, _even_info(0, vp, n, spec.vocab_size))
        else:
            self.lm_head = None
        self.commlog = None  # a CommLog (duck-typed: .tagged(tag)); the strategy does not import the runtime
        self._bwd_tag = None

    # -- tagging (only when self.commlog is set) ---------------------------------------------------------
    def _tagged(self, tag: str):
        return self.commlog.tagged(tag) if self.commlog is not None else contextlib.nullcontext()

    def _set_bwd_tag(self, tag: str):
        def hook(grad):
            self.end_tags()
            self._bwd_tag = self.commlog.tagged(tag)
            self._bwd_tag.__enter__()
        return hook

    def end_tags(self) -> None:
        """Close the backward tag the last hook opened (call after ``backward`` when ``commlog`` is set)."""
        if self._bwd_tag is not None:
            self._bwd_tag.__exit__(None, None, None)
            self._bwd_tag = None

    def _hook(self, t: torch.Tensor, tag: str) -> None:
        if self.commlog is not None and t.requires_grad:
            t.register_hook(self._set_bwd_tag(tag))

    # -- forward ------------------------------------------------------------------------------------------
    def embed_tokens(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] -> hidden [B, T, H] (or this rank's sequence shard [B, T/tp, H] with SP)."""
        x = self.embed(tokens)  # (B, T) -> (B, T, H), or (B, T/tp, H) with SP
        if self.pos_embed is not None:
            pos = torch.arange(tokens.shape[1], device=tokens.device) if positions is None else positions  # (T,)
            if self.sequence_parallel:
                pos = _split_dim(pos, 0, self.group)  # (T/tp,): this rank's positions
            x = x + self.pos_embed(pos)  # + (T, H), or (T/tp, H) with SP
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """hidden -> this rank's logits block [B, T, Vp/tp] (final norm, column-parallel output layer)."""
        x = self.norm(x)  # (B, T, H), or (B, T/tp, H) with SP
        w = self.lm_head.weight if self.lm_head is not None else self.embed.weight  # (Vp/tp, H)
        (logits,) = column_region(x, [(w, None)], mode="sp" if self.sequence_parallel else "copy",
                                  group=self.group, regather=self.regather)  # f (SP: all-gather): (B, T, Vp/tp)
        return logits

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] int64 -> this rank's logits [B, T, padded_vocab/tp]. Raises ValueError when T exceeds
        max_seq_len or, with sequence parallelism, tp does not divide T."""
        self.spec.check_seq_len(tokens.shape[1], "sequence length")
        if self.sequence_parallel:
            check_divides("tp", self.tp, "seq_len", tokens.shape[1], hint="sequence parallelism splits the sequence")
        self.end_tags()
        with self._tagged("embed/fwd"):
            x = self.embed_tokens(tokens, positions)  # (B, T) -> (B, T, H), or (B, T/tp, H) with SP
        self._hook(x, "embed/bwd")
        for i, layer in enumerate(self.layers):
            with self._tagged(f"layer{i}/fwd"):
                x = layer(x, positions)  # (B, T, H), or (B, T/tp, H) with SP
            self._hook(x, f"layer{i}/bwd")
        with self._tagged("head/fwd"):
            logits = self.head(x)  # (B, T, Vp/tp)
        self._hook(logits, "head/bwd")
        return _tag(logits, "shard(-1)")  # (B, T, Vp/tp): this rank's vocabulary block

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of this rank's logits block (:func:`vocab_parallel_cross_entropy`);
        the same value on every rank, equal to ``labkit.models.lm_loss`` of the whole logits."""
        with self._tagged("loss/fwd"):
            return vocab_parallel_cross_entropy(logits, targets, self.vocab_size, self.group)  # (B, T, Vp/tp) -> ()


def apply_tp(model: Transformer, group=None, *, sequence_parallel: bool = False, pad_vocab: bool = False,
             regather: bool = True) -> TPTransformer:
    """Tensor-parallelise the lab's model over ``group`` (default: all ranks), sharding FROM its full weights.

    Every rank must pass the same full model (``build_model(spec, seed)`` gives identical weights on every
    rank), so tp=1, 2, 4, 8 all start from the same function; initialising each shard independently would
    not (the field case of loss curves 0.25-0.33 apart between tp degrees). The blocks of ``model`` are
    reused (their attention and MLP replaced), so do not use ``model`` afterwards.

    ``sequence_parallel``: Korthikanti et al. 2022 (Section 4.2.2). ``regather``: with SP, store linear inputs
    sharded and all-gather them again in the backward. ``pad_vocab``: pad the vocabulary to a multiple of tp.
    Raises ValueError from :func:`labkit.theory.tensor.check_tp`.
    """
    return TPTransformer(model, group, sequence_parallel=sequence_parallel, pad_vocab=pad_vocab,
                         regather=regather)


def finalize_grads(model: nn.Module, group=None) -> int:
    """Sum, over the TP group, the gradients each rank holds only part of; call after ``backward``.

    Two kinds (one all-reduce for both, flattened): parameters that act on a sequence shard under SP (norm
    weights/biases, row-layer biases, learned positions: Megatron-LM all-reduces these "sequence parallel"
    gradients the same way), and replicated kv heads (each rank adds its gradient into its head's slot of a
    zero buffer [n_kv_heads, ...]). Returns the bytes all-reduced (0 when nothing needs it).
    """
    items = []
    for p in model.parameters():
        if p.grad is None:
            continue
        if getattr(p, "_tp_partial", False):
            items.append((p, 0, 1))
        elif hasattr(p, "_tp_kv_slot"):
            items.append((p, *p._tp_kv_slot))
    if not items or tp_size(group) == 1:
        return 0
    chunks = []
    for p, slot, n_slots in items:
        buf = torch.zeros((n_slots,) + tuple(p.grad.shape), dtype=p.grad.dtype, device=p.grad.device)  # (slots, *p)
        buf[slot] = p.grad
        chunks.append(buf.view(-1))
    flat = torch.cat(chunks)  # (sum of slots x numel,)
    _all_reduce(flat, group)  # one all-reduce for every partial gradient
    off = 0
    for (p, slot, n_slots), c in zip(items, chunks):
        p.grad.copy_(flat[off:off + c.numel()].view((n_slots,) + tuple(p.grad.shape))[slot])
        off += c.numel()
    return flat.numel() * flat.element_size()


def gather_full(model: nn.Module, which: str = "grad", group=None) -> dict[str, torch.Tensor]:
    """The full (unsharded, unpadded) parameters or gradients of a TP model by name, on every rank (CPU
    copies). Sharded tensors are all-gathered and placed by their
    :class:`~labkit.parallel.tensor.layers.ShardInfo`; replicated ones are returned as they are. Collective:
    every rank must call it. Raises ValueError for a bad ``which``."""
    check_choice("which", which, ("grad", "param"))
    n = tp_size(group)
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if which == "grad" else p.detach()
        if t is None:
            continue
        info = getattr(p, "_tp_shard", None)
        if info is None or n == 1:
            out[name] = t.detach().cpu().clone()
            continue
        parts = _all_gather_dim(t.detach().unsqueeze(0), 0, group)  # (tp, *local shape)
        shape = list(t.shape)
        shape[info.dim] = info.full_size
        full = torch.zeros(shape, dtype=t.dtype)
        size = t.shape[info.dim]
        for r in range(n):
            full.narrow(info.dim, info.offsets[r], size).copy_(parts[r].cpu())
        out[name] = full.narrow(info.dim, 0, info.real_size).clone()
    return out
