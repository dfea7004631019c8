"""The tensor-parallel layers (Shoeybi et al. 2019, "Megatron-LM", Section 3): column- and row-parallel
linears, the vocabulary-parallel embedding and the vocabulary-parallel cross-entropy.

Shapes: B batch, T sequence, H hidden, tp the group size, V vocabulary (Vp padded to a multiple of tp).
Every layer is built from the full weights (``from_linear`` / ``from_embedding``) or draws the full master
matrix from a seed and keeps its block, so the full function does not depend on tp. Each parameter records
where its block sits in the full tensor (:class:`ShardInfo`), which :func:`~labkit.parallel.tensor.model.gather_full`
uses to rebuild it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.checks import check_choice, check_divides, positive_int
from labkit.parallel.tensor.primitives import (
    INPUT_MODES,
    OUTPUT_MODES,
    SEQ_DIM,
    _all_reduce,
    _tag,
    column_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sp_region,
    scatter_to_tp_region,
    tp_layout,
    tp_rank,
    tp_size,
)
from labkit.theory.tensor import pad_vocab_size


@dataclass(frozen=True)
class ShardInfo:
    """Where a parameter's local block sits in the full tensor: along ``dim``, rank r's block starts at
    ``offsets[r]`` (length = local size); ``full_size`` is the (padded) full length, ``real_size`` the length
    of the unpadded tensor the reference model has."""

    dim: int
    offsets: tuple[int, ...]
    full_size: int
    real_size: int


def _mark(p: nn.Parameter, info: ShardInfo | None = None, *, partial: bool = False,
          kv_slot: tuple[int, int] | None = None) -> nn.Parameter:
    if info is not None:
        p._tp_shard = info
    if partial:
        p._tp_partial = True
    if kv_slot is not None:
        p._tp_kv_slot = kv_slot
    return p


def _even_info(dim: int, full: int, n: int, real: int | None = None) -> ShardInfo:
    k = full // n
    return ShardInfo(dim, tuple(r * k for r in range(n)), full, full if real is None else real)


def _master_weight(out_features: int, in_features: int, seed: int, std: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=g) * std


class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with A's output rows split over the group (Shoeybi et al. 2019, Section 3: ``A = [A_1,
    A_2]``, ``[Y_1, Y_2] = [GeLU(X A_1), GeLU(X A_2)]``).

    ``weight`` [out_features/tp, in_features], ``bias`` [out_features/tp]: rank r holds output rows
    ``[r*out/tp, (r+1)*out/tp)``. Input [..., in_features]: replicated (``input_mode="copy"``, applies ``f``),
    a sequence shard [B, T/tp, in] (``"sp"``), or already inside the region (``"none"``). Output
    [..., out_features/tp] (stamped ``shard(-1)``), or [..., out_features] with ``gather_output=True``.

    Weights: build with :meth:`from_linear` from a full ``nn.Linear`` (the same full weights at every tp).
    The constructor draws the full master matrix from ``seed`` (N(0, ``std``)) and keeps its block, so the
    full function also does not depend on tp (Megatron ``_initialize_affine_weight_cpu``); initialising each
    shard with its own random draw would give every tp a different model.

    Raises ValueError if tp does not divide out_features or a mode is unknown.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 input_mode: str = "copy", gather_output: bool = False, sequence_dim: int = SEQ_DIM,
                 regather: bool = True, seed: int = 0, std: float = 0.02, device=None, dtype=None):
        super().__init__()
        check_choice("input_mode", input_mode, INPUT_MODES)
        n, r = tp_size(group), tp_rank(group)
        check_divides("tp", n, "out_features", positive_int("out_features", out_features))
        self.in_features, self.out_features = positive_int("in_features", in_features), out_features
        self.group, self.input_mode, self.gather_output = group, input_mode, gather_output
        self.sequence_dim, self.regather = sequence_dim, regather
        k = out_features // n
        master = _master_weight(out_features, in_features, seed, std)
        self.weight = nn.Parameter(master[r * k:(r + 1) * k].to(device=device, dtype=dtype).clone())
        _mark(self.weight, _even_info(0, out_features, n))
        if bias:
            self.bias = nn.Parameter(torch.zeros(k, device=device, dtype=dtype))
            _mark(self.bias, _even_info(0, out_features, n))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kwargs) -> ColumnParallelLinear:
        """Shard a full ``nn.Linear`` (the same on every rank): keep this rank's block of output rows."""
        self = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                   device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        n, r = tp_size(group), tp_rank(group)
        k = linear.out_features // n
        with torch.no_grad():
            self.weight.copy_(linear.weight[r * k:(r + 1) * k])
            if self.bias is not None:
                self.bias.copy_(linear.bias[r * k:(r + 1) * k])
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, in) replicated, or (B, T/tp, in) with "sp"
        (y,) = column_region(x, [(self.weight, self.bias)], mode=self.input_mode, group=self.group,
                             dim=self.sequence_dim, regather=self.regather)  # (B, T, out/tp)
        return gather_from_tp_region(y, self.group) if self.gather_output else y  # (B, T, out) or (B, T, out/tp)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (local "
                f"{self.weight.shape[0]}), input_mode={self.input_mode!r}, gather_output={self.gather_output}")


class RowParallelLinear(nn.Module):
    """``Z = Y B^T + b`` with B's input columns split over the group (Shoeybi et al. 2019, Section 3:
    ``B = [B_1; B_2]``, ``Z = Y_1 B_1 + Y_2 B_2``), followed by the sum over ranks.

    ``weight`` [out_features, in_features/tp] (rank r: input columns ``[r*in/tp, (r+1)*in/tp)``), ``bias``
    [out_features] whole on every rank and added **once, after** the reduction (adding it on every rank
    before the all-reduce would count it tp times). Input [..., in_features/tp] (``input_is_parallel``,
    e.g. a column layer's output) or [..., in_features] (scattered first). Output [..., out_features]
    replicated (``output_mode="reduce"``: ``g``) or the sequence shard [B, T/tp, out] (``"sp"``).

    Raises ValueError if tp does not divide in_features or a mode is unknown.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, group=None,
                 input_is_parallel: bool = True, output_mode: str = "reduce", sequence_dim: int = SEQ_DIM,
                 seed: int = 0, std: float = 0.02, device=None, dtype=None):
        super().__init__()
        check_choice("output_mode", output_mode, OUTPUT_MODES)
        n, r = tp_size(group), tp_rank(group)
        check_divides("tp", n, "in_features", positive_int("in_features", in_features))
        self.in_features, self.out_features = in_features, positive_int("out_features", out_features)
        self.group, self.input_is_parallel, self.output_mode = group, input_is_parallel, output_mode
        self.sequence_dim = sequence_dim
        k = in_features // n
        master = _master_weight(out_features, in_features, seed, std)
        self.weight = nn.Parameter(master[:, r * k:(r + 1) * k].to(device=device, dtype=dtype).clone())
        _mark(self.weight, _even_info(1, in_features, n))
        if bias:
            # under SP the bias is added to a sequence shard: each rank holds part of its gradient
            self.bias = _mark(nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)),
                              partial=output_mode == "sp" and n > 1)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, **kwargs) -> RowParallelLinear:
        """Shard a full ``nn.Linear``: keep this rank's block of input columns, the whole bias."""
        self = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                   device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        n, r = tp_size(group), tp_rank(group)
        k = linear.in_features // n
        with torch.no_grad():
            self.weight.copy_(linear.weight[:, r * k:(r + 1) * k])
            if self.bias is not None:
                self.bias.copy_(linear.bias)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.group)  # (B, T, in) -> (B, T, in/tp)
        partial = F.linear(x, self.weight)  # (B, T, out), this rank's share of the sum
        if self.output_mode == "sp":
            y = reduce_scatter_to_sp_region(partial, self.group, self.sequence_dim)  # g-bar: (B, T/tp, out)
        else:
            y = reduce_from_tp_region(partial, self.group)  # g: (B, T, out) replicated
        if self.bias is not None:
            y = y + self.bias  # once, after the sum
        return _tag(y, "shard(seq)" if self.output_mode == "sp" else "replicate")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features="
                f"{self.out_features}, output_mode={self.output_mode!r}")


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split over the group (Shoeybi et al. 2019, Section 3, "input
    embedding weight matrix E [H x v] is parallelized along the vocabulary dimension").

    ``weight`` [padded_vocab/tp, H]: rank r holds token ids ``[r*Vp/tp, (r+1)*Vp/tp)``; rows past
    ``vocab_size`` (padding) are zero and never looked up. tokens [B, T] int64 -> [B, T, H] replicated
    (``output_mode="reduce"``: each rank looks up its ids, zeroes the others, all-reduce) or the sequence
    shard [B, T/tp, H] (``"sp"``: reduce-scatter instead).
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, group=None, output_mode: str = "reduce",
                 padded_vocab_size: int | None = None, seed: int = 0, std: float = 0.02, device=None,
                 dtype=None):
        super().__init__()
        check_choice("output_mode", output_mode, OUTPUT_MODES)
        n, r = tp_size(group), tp_rank(group)
        self.vocab_size = positive_int("vocab_size", vocab_size)
        self.padded_vocab_size = padded_vocab_size or self.vocab_size
        check_divides("tp", n, "padded_vocab_size", self.padded_vocab_size,
                      hint=f"pad the vocabulary to {pad_vocab_size(self.vocab_size, n)}")
        self.group, self.output_mode = group, output_mode
        k = self.padded_vocab_size // n
        self.vocab_start, self.vocab_end = r * k, (r + 1) * k
        master = torch.zeros(self.padded_vocab_size, hidden_size)
        master[:vocab_size] = _master_weight(vocab_size, hidden_size, seed, std)
        self.weight = nn.Parameter(master[r * k:(r + 1) * k].to(device=device, dtype=dtype).clone())
        _mark(self.weight, _even_info(0, self.padded_vocab_size, n, self.vocab_size))

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group=None, *, padded_vocab_size: int | None = None,
                       **kwargs) -> VocabParallelEmbedding:
        """Shard a full ``nn.Embedding`` [V, H] (zero rows appended up to ``padded_vocab_size``)."""
        self = cls(emb.num_embeddings, emb.embedding_dim, group=group, padded_vocab_size=padded_vocab_size,
                   device=emb.weight.device, dtype=emb.weight.dtype, **kwargs)
        with torch.no_grad():
            self.weight.zero_()
            lo, hi = self.vocab_start, min(self.vocab_end, self.vocab_size)
            if hi > lo:
                self.weight[: hi - lo].copy_(emb.weight[lo:hi])
        return self

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)  # (B, T) bool: ids of other ranks
        local = (tokens - self.vocab_start).masked_fill(outside, 0)  # (B, T) ids into this rank's block
        x = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (B, T, H) partial
        if self.output_mode == "sp":
            return reduce_scatter_to_sp_region(x, self.group)  # (B, T/tp, H)
        return reduce_from_tp_region(x, self.group)  # (B, T, H) replicated


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over vocabulary-split logits without gathering them (Shoeybi et al. 2019, Section 3:
    "fuse the output embedding GEMM with the cross entropy loss", so only [b x s] numbers are exchanged).

    Forward per token: m = max_v z_v (all-reduce MAX), then one all-reduce SUM of the pair
    (z_target - m on the rank that holds the target, 0 elsewhere; sum_v exp(z_v - m)):
    loss = log(sum exp) - (z_target - m). Backward: softmax - onehot(target), local, no communication.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group):
        z = logits.float()  # (B, T, Vp/tp); any leading dims, e.g. (B*T, Vp/tp), work the same
        local_v = z.shape[-1]
        col = torch.arange(vocab_start, vocab_start + local_v, device=z.device)  # (Vp/tp,) global ids
        pad = col >= vocab_size
        if vocab_start + local_v > vocab_size:  # a padded column here (decided on sizes: no data read)
            z = z.masked_fill(pad, float("-inf"))
        m = z.max(dim=-1).values  # (B, T)
        _all_reduce(m, group, dist.ReduceOp.MAX)  # (B, T): the max over the whole vocabulary
        z = z - m.unsqueeze(-1)  # (B, T, Vp/tp)
        inside = (targets >= vocab_start) & (targets < vocab_start + local_v)  # (B, T)
        local_t = (targets - vocab_start).masked_fill(~inside, 0)  # (B, T)
        picked = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)  # (B, T)
        e = z.exp()  # (B, T, Vp/tp)
        pair = torch.stack([picked, e.sum(-1)])  # (2, B, T)
        _all_reduce(pair, group)  # (2, B, T): target logit, sum of exponentials over the whole vocabulary
        loss = pair[1].log() - pair[0]  # (B, T)
        softmax = e / pair[1].unsqueeze(-1)  # (B, T, Vp/tp)
        ctx.save_for_backward(softmax, local_t, inside)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, inside = ctx.saved_tensors
        g = softmax.clone()  # (B, T, Vp/tp)
        g.scatter_add_(-1, local_t.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))  # softmax - onehot(target)
        return (g * grad.unsqueeze(-1)).to(ctx.in_dtype), None, None, None, None  # (B, T, Vp/tp)


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, group=None,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of vocabulary-parallel logits, checked for their layout.

    Args:
        logits: [..., Vp/tp] this rank's block of the (padded) vocabulary, ``Vp = pad_vocab_size(vocab_size,
            tp)``; columns past ``vocab_size`` are padding and get probability 0.
        targets: [...] int64 token ids in [0, vocab_size).
        vocab_size: the real vocabulary size. Required: the loss cannot trust the logits' shape.
        reduction: ``"mean"`` (scalar) or ``"none"`` (per token, shape of ``targets``).

    Returns the loss in fp32, equal to ``F.cross_entropy`` of the gathered logits.

    Raises ValueError when the logits are not vocabulary-split: stamped ``replicate`` (a
    :class:`RowParallelLinear` output layer, or gathered logits) or with a width other than Vp/tp. This is
    the field case of a row-parallel output layer feeding a vocab-parallel loss, which with a shape-trusting
    loss runs without error and computes a wrong loss (EleutherAI/gpt-neox issue #905).
    """
    check_choice("reduction", reduction, ("mean", "none"))
    n, r = tp_size(group), tp_rank(group)
    vp = pad_vocab_size(vocab_size, n)
    layout = tp_layout(logits)
    if layout is not None and layout != "shard(-1)":
        raise ValueError(
            f"logits have layout {layout!r} but vocab_parallel_cross_entropy needs them split over the "
            f"vocabulary ('shard(-1)', {vp // n} columns per rank). A row-parallel output layer produces whole "
            "(replicated) logits: make the output layer column-parallel, or use F.cross_entropy on whole logits")
    if logits.shape[-1] != vp // n:
        raise ValueError(
            f"logits have {logits.shape[-1]} vocabulary columns on each of tp={n} ranks, but vocab_size="
            f"{vocab_size} split over tp={n} (padded to {vp}) needs {vp // n} per rank"
            + (" — these look like whole logits (e.g. from a row-parallel output layer)"
               if logits.shape[-1] in (vocab_size, vp) and n > 1 else ""))
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal logits shape without the last "
                         f"dim {tuple(logits.shape[:-1])}")
    loss = _VocabParallelCE.apply(logits, targets, r * (vp // n), vocab_size, group)
    return loss.mean() if reduction == "mean" else loss


def _unchecked_vocab_parallel_ce(logits: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """What a loss that trusts the logits' shape computes (no layout check; vocab offset = rank x width).
    Only here to reproduce the field case: fed whole logits it runs and returns a wrong number."""
    w = logits.shape[-1]
    return _VocabParallelCE.apply(logits, targets, tp_rank(group) * w, w * tp_size(group), group).mean()

