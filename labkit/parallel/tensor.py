"""Tensor parallelism (Megatron-LM) and sequence parallelism, written by hand, beside the DTensor variant.

Tensor parallelism (TP) splits the matrices inside a layer over the ``tp`` ranks of a process group
(Shoeybi et al. 2019, "Megatron-LM", Section 3):

* a **column-parallel** linear ``Y = X A`` keeps a block of A's columns, ``A = [A_1 ... A_tp]``: every rank
  computes ``Y_i = X A_i`` from the whole input, and the output is split along its last dimension;
* a **row-parallel** linear ``Z = Y B`` keeps a block of B's rows: rank i computes ``Y_i B_i`` from its part of
  the input, and the partial results are summed over the ranks (one all-reduce).

Column then row (MLP: ``fc_in`` then ``fc_out``; attention: ``wq/wk/wv`` then ``wo``) needs one all-reduce in
the forward pass (``g``) and one in the backward pass (``f``) per block, so 2 + 2 per transformer layer
(Shoeybi et al. 2019, Figure 4). Two column layers in a row would need the activations gathered in between
(:func:`comm_theory_mlp_pair`).

Sequence parallelism (SP, Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", Section 4.2.2, Figure 5) also splits the parts between the blocks (norms, residuals, dropout) along
the sequence: the all-reduce becomes a reduce-scatter (``g-bar``) after the row layer and an all-gather before
the column layer, the same bytes on a ring; activations outside the blocks are stored ``1/tp`` per rank.

What is here:

* the region functions (autograd): :func:`copy_to_tp_region` (``f``), :func:`reduce_from_tp_region` (``g``),
  :func:`gather_from_tp_region`, :func:`scatter_to_tp_region`, :func:`gather_from_sp_region`,
  :func:`reduce_scatter_to_sp_region`, :func:`scatter_to_sp_region`, and :func:`column_region` (several
  column layers that share one input, as Megatron's fused QKV);
* :class:`ColumnParallelLinear`, :class:`RowParallelLinear`, :class:`VocabParallelEmbedding`,
  :func:`vocab_parallel_cross_entropy` (the layout of the logits is checked, so a row-parallel output layer
  raises instead of silently computing a wrong loss), :class:`ParallelAttention` (GQA: kv heads split, or
  replicated when ``n_kv_heads < tp``), :class:`ParallelMLP`;
* :func:`apply_tp` -> :class:`TPTransformer` for the lab's model (sharded from the full weights every rank
  built, so every tp starts from the same function), :func:`finalize_grads`, :func:`gather_full`;
* :func:`check_tp`: every bad input as a ValueError before any launch;
* :func:`apply_dtensor_tp`: the same plan with ``torch.distributed.tensor.parallel.parallelize_module``;
* predictions: :func:`comm_theory_per_layer`, :func:`comm_theory_model`, :func:`comm_theory_mlp_pair`;
* rank functions for ``launch``: :func:`tp_check_rank` (parity, counted collectives, activation bytes: one
  launch checks everything) and :func:`step_time_rank` (hand TP vs DTensor vs tp=1 step times).

Dropout is refused (ValueError): with TP, dropout inside a region needs a different random stream per rank
and outside it the same one (Megatron's RNG tracker); the lab's models use dropout 0.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.chapters.common import check_fits_in_memory, check_world_size
from labkit.checks import check_choice, check_divides, positive_float, positive_int
from labkit.models import (
    TOLERANCES,
    Attention,
    GeluMLP,
    SwiGLU,
    SyntheticLM,
    Transformer,
    apply_rope,
    build_model,
    lm_loss,
    make_optimizer,
)
from labkit.runtime.commlog import CommLog, all_gather_tensor, bus_factor, reduce_scatter_tensor
from labkit.theory.spec import ModelSpec, get_spec

SEQ_DIM = 1  # the lab's activations are [batch, seq, hidden]: sequence parallelism splits dim 1
INPUT_MODES = ("copy", "sp", "none")
OUTPUT_MODES = ("reduce", "sp")
LAYOUT_ATTR = "_labkit_tp_layout"


# ------------------------------------------------------------------------------------------------------
# process-group helpers and raw collectives along a dimension
# ------------------------------------------------------------------------------------------------------
def tp_size(group=None) -> int:
    """Ranks in the TP group (``group=None``: the default group)."""
    return dist.get_world_size(group)


def tp_rank(group=None) -> int:
    """This rank's index inside the TP group."""
    return dist.get_rank(group)


def _all_gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order). One all-gather of n x x.nbytes bytes."""
    n = tp_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    x = x.contiguous()
    out = torch.empty((n,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    all_gather_tensor(out.view(-1), x.view(-1), group=group)
    return out.movedim(0, dim).flatten(dim, dim + 1)


def _reduce_scatter_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's ``1/n`` chunk along ``dim``. One reduce-scatter of
    x.nbytes bytes."""
    n = tp_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    check_divides("tp", n, f"size of dim {dim}", x.shape[dim])
    chunks = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    reduce_scatter_tensor(out.view(-1), chunks.view(-1), group=group)
    return out


def _split_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's ``1/n`` chunk of ``x`` along ``dim`` (no communication)."""
    n = tp_size(group)
    if n == 1:
        return x
    check_divides("tp", n, f"size of dim {dim % x.dim()}", x.shape[dim])
    return x.chunk(n, dim)[tp_rank(group)].contiguous()


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if tp_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _tag(t: torch.Tensor, layout: str) -> torch.Tensor:
    setattr(t, LAYOUT_ATTR, layout)
    return t


def tp_layout(t: torch.Tensor) -> str | None:
    """The layout a TP layer stamped on its output: ``"shard(-1)"`` (split over the last dim: a column
    layer's output), ``"replicate"`` (whole on every rank: a row layer's reduced output, a gathered output),
    ``"shard(seq)"`` (a sequence-parallel output), or None for a tensor no TP layer produced directly."""
    return getattr(t, LAYOUT_ATTR, None)


# ------------------------------------------------------------------------------------------------------
# region functions (Megatron-LM names)
# ------------------------------------------------------------------------------------------------------
class _CopyToTPRegion(torch.autograd.Function):
    """``f``: identity forward, all-reduce backward (Megatron ``copy_to_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTPRegion(torch.autograd.Function):
    """``g``: all-reduce forward, identity backward (Megatron ``reduce_from_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTPRegion(torch.autograd.Function):
    """All-gather along the last dim forward, keep own chunk backward
    (Megatron ``gather_from_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_dim(grad, -1, ctx.group), None


class _ScatterToTPRegion(torch.autograd.Function):
    """Keep own chunk of the last dim forward, all-gather backward
    (Megatron ``scatter_to_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, -1, ctx.group), None


class _GatherFromSPRegion(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward (Korthikanti et al. 2022, ``g``
    in Figure 5; Megatron ``gather_from_sequence_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterToSPRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward (Korthikanti et al. 2022,
    ``g-bar`` in Figure 5; Megatron ``reduce_scatter_to_sequence_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, ctx.dim, ctx.group), None, None


class _ScatterToSPRegion(torch.autograd.Function):
    """Keep own chunk of the sequence forward, all-gather backward
    (Megatron ``scatter_to_sequence_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, ctx.dim, ctx.group), None, None


def copy_to_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """``f`` (Shoeybi et al. 2019, Section 3, Figure 3a): identity forward, all-reduce of the gradient
    backward. Enter a column-parallel region with a replicated input. Shape unchanged."""
    return _CopyToTPRegion.apply(x, group)


def reduce_from_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """``g`` (Shoeybi et al. 2019, Figure 3a): all-reduce (sum) forward, identity backward. Leave a
    row-parallel region. Shape unchanged; the result is replicated."""
    return _tag(_ReduceFromTPRegion.apply(x, group), "replicate")


def gather_from_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather along the last dim: [..., k] -> [..., tp*k] forward; backward keeps this rank's chunk."""
    return _tag(_GatherFromTPRegion.apply(x, group), "replicate")


def scatter_to_tp_region(x: torch.Tensor, group=None) -> torch.Tensor:
    """Keep this rank's chunk of the last dim: [..., K] -> [..., K/tp]; backward all-gathers.
    Raises ValueError if tp does not divide K."""
    return _tag(_ScatterToTPRegion.apply(x, group), "shard(-1)")


def gather_from_sp_region(x: torch.Tensor, group=None, dim: int = SEQ_DIM) -> torch.Tensor:
    """All-gather along the sequence: [B, T/tp, H] -> [B, T, H]; backward reduce-scatters the gradient."""
    return _tag(_GatherFromSPRegion.apply(x, group, dim), "replicate")


def reduce_scatter_to_sp_region(x: torch.Tensor, group=None, dim: int = SEQ_DIM) -> torch.Tensor:
    """Sum over ranks and keep this rank's sequence chunk: [B, T, H] (partial) -> [B, T/tp, H];
    backward all-gathers. Raises ValueError if tp does not divide T."""
    return _tag(_ReduceScatterToSPRegion.apply(x, group, dim), "shard(seq)")


def scatter_to_sp_region(x: torch.Tensor, group=None, dim: int = SEQ_DIM) -> torch.Tensor:
    """Keep this rank's sequence chunk of a replicated [B, T, H] -> [B, T/tp, H]; backward all-gathers."""
    return _tag(_ScatterToSPRegion.apply(x, group, dim), "shard(seq)")


class _SPColumnRegion(torch.autograd.Function):
    """All-gather the sequence shard once, apply several column-parallel linears to the gathered input.

    Forward: ``X = all_gather(x)`` then ``Y_j = X W_j^T + b_j``. Only the shard ``x`` is saved (plus the
    weights); backward all-gathers it again to form the weight gradients, and reduce-scatters
    ``sum_j dY_j W_j``. This is Megatron-LM's sequence-parallel linear (Korthikanti et al. 2022, Section
    4.2.2: "we store the sharded input and perform an extra all-gather in the backward pass"): the linear
    inputs are then stored ``1/tp`` per rank, at the cost of one extra all-gather per region in the backward.
    """

    @staticmethod
    def forward(ctx, x, group, dim, regather, *params):
        ctx.group, ctx.dim, ctx.regather = group, dim, regather
        ctx.has_bias = [b is not None for b in params[1::2]]
        x_full = _all_gather_dim(x, dim, group)
        weights = params[0::2]
        outs = tuple(F.linear(x_full, w, b) for w, b in zip(weights, params[1::2]))
        ctx.save_for_backward(x if regather else x_full, *weights)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        saved, *weights = ctx.saved_tensors
        x_full = _all_gather_dim(saved, ctx.dim, ctx.group) if ctx.regather else saved
        x2 = x_full.reshape(-1, x_full.shape[-1])
        dx_full = None
        out = []
        for g, w, has_b in zip(grads, weights, ctx.has_bias):
            g2 = g.reshape(-1, g.shape[-1])
            contrib = g @ w
            dx_full = contrib if dx_full is None else dx_full + contrib
            out.append(g2.t() @ x2)
            out.append(g2.sum(0) if has_b else None)
        dx = _reduce_scatter_dim(dx_full, ctx.dim, ctx.group)
        return (dx, None, None, None, *out)


def column_region(x: torch.Tensor, params: list[tuple[torch.Tensor, torch.Tensor | None]], *, mode: str = "copy",
                  group=None, dim: int = SEQ_DIM, regather: bool = True) -> list[torch.Tensor]:
    """Enter one column-parallel region and apply several column-parallel linears to the same input.

    Megatron fuses ``wq/wk/wv`` (and the SwiGLU gate/up) into one matrix so the region entry happens once:
    one all-reduce in the backward (``mode="copy"``), or one all-gather forward and one reduce-scatter
    backward (``mode="sp"``) instead of one per linear. Here the linears stay separate modules.

    Args:
        x: ``[B, T, H]`` replicated (``copy``, ``none``) or ``[B, T/tp, H]`` sequence shard (``sp``).
        params: ``(weight [out_j/tp, H], bias [out_j/tp] or None)`` per linear.
        mode: ``"copy"`` (``f``: identity forward, all-reduce backward), ``"sp"`` (all-gather forward,
            reduce-scatter backward; :class:`_SPColumnRegion`), ``"none"`` (input already in the region).
        regather: with ``sp``, save only the sequence shard and all-gather it again in the backward
            (Korthikanti et al. 2022, Section 4.2.2); False saves the gathered input instead.

    Returns: ``[B, T, out_j/tp]`` per linear, each stamped ``shard(-1)``. Raises ValueError for a bad mode.
    """
    check_choice("mode", mode, INPUT_MODES)
    if mode == "sp":
        flat = [t for wb in params for t in wb]
        outs = _SPColumnRegion.apply(x, group, dim, regather, *flat)
    else:
        if mode == "copy":
            x = copy_to_tp_region(x, group)
        outs = [F.linear(x, w, b) for w, b in params]
    return [_tag(o, "shard(-1)") for o in outs]


# ------------------------------------------------------------------------------------------------------
# layers
# ------------------------------------------------------------------------------------------------------
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (y,) = column_region(x, [(self.weight, self.bias)], mode=self.input_mode, group=self.group,
                             dim=self.sequence_dim, regather=self.regather)
        return gather_from_tp_region(y, self.group) if self.gather_output else y

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
            x = scatter_to_tp_region(x, self.group)
        partial = F.linear(x, self.weight)
        if self.output_mode == "sp":
            y = reduce_scatter_to_sp_region(partial, self.group, self.sequence_dim)
        else:
            y = reduce_from_tp_region(partial, self.group)
        if self.bias is not None:
            y = y + self.bias
        return _tag(y, "shard(seq)" if self.output_mode == "sp" else "replicate")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features="
                f"{self.out_features}, output_mode={self.output_mode!r}")


def pad_vocab_size(vocab_size: int, tp: int, multiple: int = 1) -> int:
    """The smallest multiple of ``tp * multiple`` >= vocab_size (Megatron-LM pads to a multiple of
    ``make_vocab_size_divisible_by * tp``, default 128 * tp, so the vocabulary splits evenly).
    Raises ValueError for non-positive arguments."""
    vocab_size = positive_int("vocab_size", vocab_size)
    step = positive_int("tp", tp) * positive_int("multiple", multiple)
    return -(-vocab_size // step) * step


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
        outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(outside, 0)
        x = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.output_mode == "sp":
            return reduce_scatter_to_sp_region(x, self.group)
        return reduce_from_tp_region(x, self.group)


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over vocabulary-split logits without gathering them (Shoeybi et al. 2019, Section 3:
    "fuse the output embedding GEMM with the cross entropy loss", so only [b x s] numbers are exchanged).

    Forward per token: m = max_v z_v (all-reduce MAX), then one all-reduce SUM of the pair
    (z_target - m on the rank that holds the target, 0 elsewhere; sum_v exp(z_v - m)):
    loss = log(sum exp) - (z_target - m). Backward: softmax - onehot(target), local, no communication.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group):
        z = logits.float()
        local_v = z.shape[-1]
        col = torch.arange(vocab_start, vocab_start + local_v, device=z.device)
        pad = col >= vocab_size
        if bool(pad.any()):
            z = z.masked_fill(pad, float("-inf"))
        m = z.max(dim=-1).values
        _all_reduce(m, group, dist.ReduceOp.MAX)
        z = z - m.unsqueeze(-1)
        inside = (targets >= vocab_start) & (targets < vocab_start + local_v)
        local_t = (targets - vocab_start).masked_fill(~inside, 0)
        picked = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        e = z.exp()
        pair = torch.stack([picked, e.sum(-1)])
        _all_reduce(pair, group)
        loss = pair[1].log() - pair[0]
        softmax = e / pair[1].unsqueeze(-1)
        ctx.save_for_backward(softmax, local_t, inside)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, inside = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local_t.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        return (g * grad.unsqueeze(-1)).to(ctx.in_dtype), None, None, None, None


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


# ------------------------------------------------------------------------------------------------------
# attention and MLP blocks
# ------------------------------------------------------------------------------------------------------
def kv_plan(n_heads: int, n_kv_heads: int, tp: int) -> str:
    """``"split"`` when tp divides n_kv_heads, ``"replicate"`` when n_kv_heads < tp and divides it (each kv
    head is kept by the tp/n_kv_heads ranks whose query heads use it). Raises ValueError otherwise."""
    from labkit.theory.memory import kv_heads_per_rank

    kv_heads_per_rank(n_heads, n_kv_heads, tp)  # the one rule (memory, mesh, this module); raises ValueError
    return "split" if n_kv_heads % tp == 0 else "replicate"


def _shard_rows(linear: nn.Linear, start: int, size: int, group, info: ShardInfo, kv_slot=None) -> nn.Linear:
    """A local nn.Linear holding rows [start, start+size) of ``linear`` (a column shard)."""
    out = nn.Linear(linear.in_features, size, bias=linear.bias is not None, device=linear.weight.device,
                    dtype=linear.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(linear.weight[start:start + size])
        _mark(out.weight, info, kv_slot=kv_slot)
        if out.bias is not None:
            out.bias.copy_(linear.bias[start:start + size])
            _mark(out.bias, ShardInfo(0, info.offsets, info.full_size, info.real_size), kv_slot=kv_slot)
    return out


class ParallelAttention(nn.Module):
    """Self-attention with its heads split over the group (Shoeybi et al. 2019, Section 3, Figure 3b).

    ``wq`` holds this rank's n_heads/tp query heads, ``wk``/``wv`` its n_kv_heads/tp kv heads ("split"), or
    the one kv head its query heads share when n_kv_heads < tp ("replicate": that head's rows are kept by
    tp/n_kv_heads ranks and its gradient summed over them by :func:`finalize_grads`); ``wo`` is row-parallel.
    Same parameter names as :class:`labkit.models.Attention`. x [B, T, H] (or [B, T/tp, H] with sequence
    parallelism) -> the same shape.
    """

    def __init__(self, attn: Attention, n_heads: int, n_kv_heads: int, group=None, *,
                 sequence_parallel: bool = False, regather: bool = True):
        super().__init__()
        n, r = tp_size(group), tp_rank(group)
        self.plan = kv_plan(n_heads, n_kv_heads, n)
        d = attn.head_dim
        self.head_dim, self.dropout_p, self.core, self.use_rope = d, attn.dropout_p, attn.core, attn.use_rope
        self.group, self.regather = group, regather
        self.mode = "sp" if sequence_parallel else "copy"
        hq = n_heads // n
        self.wq = _shard_rows(attn.wq, r * hq * d, hq * d, group, _even_info(0, n_heads * d, n))
        if self.plan == "split":
            hk = n_kv_heads // n
            info = _even_info(0, n_kv_heads * d, n)
            slot = None
            start = r * hk * d
        else:
            hk = 1
            heads = [rr * n_kv_heads // n for rr in range(n)]  # kv head used by rank rr's query heads
            info = ShardInfo(0, tuple(h * d for h in heads), n_kv_heads * d, n_kv_heads * d)
            slot = (heads[r], n_kv_heads)
            start = heads[r] * d
        self.wk = _shard_rows(attn.wk, start, hk * d, group, info, slot)
        self.wv = _shard_rows(attn.wv, start, hk * d, group, info, slot)
        self.wo = RowParallelLinear.from_linear(attn.wo, group, output_mode="sp" if sequence_parallel else "reduce")
        if self.use_rope:
            self.register_buffer("rope_cos", attn.rope_cos, persistent=False)
            self.register_buffer("rope_sin", attn.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = column_region(x, [(m.weight, m.bias) for m in (self.wq, self.wk, self.wv)], mode=self.mode,
                                group=self.group, regather=self.regather)
        b, t, _ = q.shape
        d = self.head_dim
        # from here on, the same arithmetic as labkit.models.Attention.forward on this rank's heads
        q, k, v = (z.view(b, t, -1, d).transpose(1, 2) for z in (q, k, v))
        if self.use_rope:
            pos = torch.arange(t, device=x.device) if positions is None else positions
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        out = self.core(q, k, v, causal=True, dropout_p=self.dropout_p, training=self.training)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class ParallelMLP(nn.Module):
    """The MLP as column then row (Shoeybi et al. 2019, Section 3, Figure 3a): the nonlinearity acts on each
    rank's own columns, so no communication sits between the two matmuls.

    SwiGLU: ``w_gate``, ``w_up`` column-parallel (one region), ``w_down`` row-parallel; GELU(tanh):
    ``fc_in`` column-parallel, ``fc_out`` row-parallel. Same parameter names as the module it shards.
    x [B, T, H] (or [B, T/tp, H] with sequence parallelism) -> the same shape.
    """

    def __init__(self, mlp: nn.Module, group=None, *, sequence_parallel: bool = False, regather: bool = True):
        super().__init__()
        n, r = tp_size(group), tp_rank(group)
        self.group, self.regather = group, regather
        self.mode = "sp" if sequence_parallel else "copy"
        out_mode = "sp" if sequence_parallel else "reduce"
        if isinstance(mlp, SwiGLU):
            self.kind = "swiglu"
            f = mlp.w_gate.out_features
            check_divides("tp", n, "ffn_hidden_size", f)
            info = _even_info(0, f, n)
            self.w_gate = _shard_rows(mlp.w_gate, r * f // n, f // n, group, info)
            self.w_up = _shard_rows(mlp.w_up, r * f // n, f // n, group, info)
            self.w_down = RowParallelLinear.from_linear(mlp.w_down, group, output_mode=out_mode)
        elif isinstance(mlp, GeluMLP):
            self.kind = "gelu"
            f = mlp.fc_in.out_features
            check_divides("tp", n, "ffn_hidden_size", f)
            self.fc_in = _shard_rows(mlp.fc_in, r * f // n, f // n, group, _even_info(0, f, n))
            self.fc_out = RowParallelLinear.from_linear(mlp.fc_out, group, output_mode=out_mode)
        else:
            raise ValueError(f"cannot tensor-parallelise a {type(mlp).__name__}; expected SwiGLU or GeluMLP")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            gate, up = column_region(x, [(self.w_gate.weight, self.w_gate.bias), (self.w_up.weight, self.w_up.bias)],
                                     mode=self.mode, group=self.group, regather=self.regather)
            return self.w_down(F.silu(gate) * up)
        (h,) = column_region(x, [(self.fc_in.weight, self.fc_in.bias)], mode=self.mode, group=self.group,
                             regather=self.regather)
        return self.fc_out(F.gelu(h, approximate="tanh"))


# ------------------------------------------------------------------------------------------------------
# the whole model
# ------------------------------------------------------------------------------------------------------
def check_tp(spec: ModelSpec | str, tp: int, *, pad_vocab: bool = False, sequence_parallel: bool = False,
             seq_len: int | None = None, dtensor: bool = False) -> dict:
    """Validate tensor parallelism of degree ``tp`` for ``spec`` before anything is launched.

    Returns the plan: ``{"tp", "kv": "split" | "replicate", "vocab_size", "padded_vocab_size",
    "sequence_parallel"}``.

    Raises ValueError naming the value and the valid choices when tp does not divide n_heads, ffn_hidden_size
    or vocab_size (unless ``pad_vocab``: the message offers it), when the kv heads can be neither split nor
    replicated, when ``sequence_parallel`` and tp does not divide ``seq_len``, when dropout > 0 (needs a
    per-region RNG, not implemented), and for the DTensor variant (``dtensor=True``) when the kv heads would
    need replicating, the embeddings are tied, or SP meets learned positions.
    """
    if isinstance(spec, str):
        spec = get_spec(spec)
    tp = positive_int("tp", tp)
    check_divides("tp", tp, "n_heads", spec.n_heads)
    kv = kv_plan(spec.n_heads, spec.n_kv_heads, tp)
    check_divides("tp", tp, "ffn_hidden_size", spec.ffn_hidden_size)
    vp = pad_vocab_size(spec.vocab_size, tp)
    if spec.vocab_size % tp and not pad_vocab:
        check_divides("tp", tp, "vocab_size", spec.vocab_size,
                      hint=f"or pad the vocabulary to {vp} with pad_vocab=True (Megatron-LM pads to a multiple "
                           "of 128*tp)")
    if sequence_parallel and seq_len is not None:
        check_divides("tp", tp, "seq_len", positive_int("seq_len", seq_len),
                      hint="sequence parallelism splits the sequence")
    if spec.dropout:
        raise ValueError(f"dropout={spec.dropout} is not supported with tensor parallelism here: dropout inside "
                         "a TP region needs a different random stream per rank and outside it the same one "
                         "(Megatron-LM's RNG tracker); use dropout=0")
    if dtensor:
        if kv != "split":
            raise ValueError(f"the DTensor variant shards wk/wv with ColwiseParallel, which needs tp to divide "
                             f"n_kv_heads={spec.n_kv_heads}; tp={tp} would need replicated kv heads (hand TP "
                             "does that: apply_tp)")
        if spec.tied_embeddings:
            raise ValueError("the DTensor variant does not support tied embeddings (the head would reuse a "
                             "Shard(0) DTensor weight on a plain tensor); use apply_tp")
        if spec.vocab_size % tp:
            check_divides("tp", tp, "vocab_size", spec.vocab_size, hint="the DTensor variant does not pad")
        if sequence_parallel and spec.position == "learned":
            raise ValueError("the DTensor variant with sequence_parallel=True supports RoPE models only "
                             f"(position={spec.position!r} adds a plain tensor to a Shard(1) DTensor)")
    return {"tp": tp, "kv": kv, "vocab_size": spec.vocab_size, "padded_vocab_size": vp if spec.vocab_size % tp
            else spec.vocab_size, "sequence_parallel": sequence_parallel}


class TPTransformer(nn.Module):
    """The lab's :class:`~labkit.models.Transformer` with tensor (and optionally sequence) parallelism.

    Same parameter names as the model it was built from (``embed.weight``, ``layers.0.attn.wq.weight``, ...),
    each holding this rank's block (see ``param._tp_shard`` / :class:`ShardInfo`). tokens [B, T] ->
    logits [B, T, Vp/tp] (this rank's vocabulary block, stamped ``shard(-1)``); :meth:`loss` is the
    vocab-parallel cross-entropy. With sequence parallelism the residual stream between blocks is
    [B, T/tp, H].

    ``commlog``: set to a :class:`~labkit.runtime.commlog.CommLog` to tag every collective with its place and phase
    (``embed/fwd``, ``layer3/fwd``, ``layer3/bwd``, ``head/bwd``...). Backward tags are set by gradient hooks
    on the block outputs, so the collectives of layer i's backward carry ``layer{i}/bwd``.
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
        self.commlog: CommLog | None = None
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
        x = self.embed(tokens)
        if self.pos_embed is not None:
            pos = torch.arange(tokens.shape[1], device=tokens.device) if positions is None else positions
            if self.sequence_parallel:
                pos = _split_dim(pos, 0, self.group)
            x = x + self.pos_embed(pos)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """hidden -> this rank's logits block [B, T, Vp/tp] (final norm, column-parallel output layer)."""
        x = self.norm(x)
        w = self.lm_head.weight if self.lm_head is not None else self.embed.weight
        (logits,) = column_region(x, [(w, None)], mode="sp" if self.sequence_parallel else "copy",
                                  group=self.group, regather=self.regather)
        return logits

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] int64 -> this rank's logits [B, T, padded_vocab/tp]. Raises ValueError when T exceeds
        max_seq_len or, with sequence parallelism, tp does not divide T."""
        self.spec.check_seq_len(tokens.shape[1], "sequence length")
        if self.sequence_parallel:
            check_divides("tp", self.tp, "seq_len", tokens.shape[1], hint="sequence parallelism splits the sequence")
        self.end_tags()
        with self._tagged("embed/fwd"):
            x = self.embed_tokens(tokens, positions)
        self._hook(x, "embed/bwd")
        for i, layer in enumerate(self.layers):
            with self._tagged(f"layer{i}/fwd"):
                x = layer(x, positions)
            self._hook(x, f"layer{i}/bwd")
        with self._tagged("head/fwd"):
            logits = self.head(x)
        self._hook(logits, "head/bwd")
        return _tag(logits, "shard(-1)")

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of this rank's logits block (:func:`vocab_parallel_cross_entropy`);
        the same value on every rank, equal to ``labkit.models.lm_loss`` of the whole logits."""
        with self._tagged("loss/fwd"):
            return vocab_parallel_cross_entropy(logits, targets, self.vocab_size, self.group)


def apply_tp(model: Transformer, group=None, *, sequence_parallel: bool = False, pad_vocab: bool = False,
             regather: bool = True) -> TPTransformer:
    """Tensor-parallelise the lab's model over ``group`` (default: all ranks), sharding FROM its full weights.

    Every rank must pass the same full model (``build_model(spec, seed)`` gives identical weights on every
    rank), so tp=1, 2, 4, 8 all start from the same function; initialising each shard independently would
    not (the field case of loss curves 0.25-0.33 apart between tp degrees). The blocks of ``model`` are
    reused (their attention and MLP replaced), so do not use ``model`` afterwards.

    ``sequence_parallel``: Korthikanti et al. 2022 (Section 4.2.2). ``regather``: with SP, store linear inputs
    sharded and all-gather them again in the backward. ``pad_vocab``: pad the vocabulary to a multiple of tp.
    Raises ValueError from :func:`check_tp`.
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
        buf = torch.zeros((n_slots,) + tuple(p.grad.shape), dtype=p.grad.dtype, device=p.grad.device)
        buf[slot] = p.grad
        chunks.append(buf.view(-1))
    flat = torch.cat(chunks)
    _all_reduce(flat, group)
    off = 0
    for (p, slot, n_slots), c in zip(items, chunks):
        p.grad.copy_(flat[off:off + c.numel()].view((n_slots,) + tuple(p.grad.shape))[slot])
        off += c.numel()
    return flat.numel() * flat.element_size()


def gather_full(model: nn.Module, which: str = "grad", group=None) -> dict[str, torch.Tensor]:
    """The full (unsharded, unpadded) parameters or gradients of a TP model by name, on every rank (CPU
    copies). Sharded tensors are all-gathered and placed by their :class:`ShardInfo`; replicated ones are
    returned as they are. Collective: every rank must call it. Raises ValueError for a bad ``which``."""
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
        parts = _all_gather_dim(t.detach().unsqueeze(0), 0, group)
        shape = list(t.shape)
        shape[info.dim] = info.full_size
        full = torch.zeros(shape, dtype=t.dtype)
        size = t.shape[info.dim]
        for r in range(n):
            full.narrow(info.dim, info.offsets[r], size).copy_(parts[r].cpu())
        out[name] = full.narrow(info.dim, 0, info.real_size).clone()
    return out


# ------------------------------------------------------------------------------------------------------
# DTensor variant
# ------------------------------------------------------------------------------------------------------
def apply_dtensor_tp(model: Transformer, mesh=None, *, sequence_parallel: bool = False) -> Transformer:
    """The same plan with torch's DTensor API (``parallelize_module`` with ``ColwiseParallel``,
    ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``; the plan torchtitan uses for Llama).

    Parallelises ``model`` in place (its parameters become DTensors sharded from the full weights) and returns
    it. The logits come out as a ``Shard(-1)`` DTensor: compute the loss with :func:`dtensor_loss`
    (``loss_parallel``). ``mesh``: a 1-D DeviceMesh (default: all ranks on ``ctx``'s device type).
    Checked on gloo/CPU with torch 2.13. Raises ValueError from :func:`check_tp` (``dtensor=True``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if mesh is None:
        dev = next(model.parameters()).device.type
        mesh = init_device_mesh(dev, (dist.get_world_size(),))
    check_tp(model.spec, mesh.size(), sequence_parallel=sequence_parallel, dtensor=True)
    sp = sequence_parallel
    seq = Shard(1) if sp else Replicate()
    top = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
           "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)}
    if sp:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    names = ("w_gate", "w_up", "w_down") if isinstance(model.layers[0].mlp, SwiGLU) else ("fc_in", None, "fc_out")
    for blk in model.layers:
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(output_layouts=seq),
                f"mlp.{names[0]}": ColwiseParallel(), f"mlp.{names[2]}": RowwiseParallel(output_layouts=seq)}
        if names[1]:
            plan[f"mlp.{names[1]}"] = ColwiseParallel()
        if sp:
            plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
                         "attn": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                    desired_input_layouts=(Replicate(), None)),
                         "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))})
        parallelize_module(blk, mesh, plan)
    return model


def dtensor_loss(logits, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``Shard(-1)`` DTensor logits under ``loss_parallel()`` (no gather of logits)."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _dtensor_backward(loss) -> None:
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        loss.backward()


def _full(t) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ------------------------------------------------------------------------------------------------------
# predictions: collectives per layer and per model
# ------------------------------------------------------------------------------------------------------
def _row(where: str, phase: str, op: str, calls: int, nbytes: int, n: int, why: str) -> dict:
    return {"where": where, "phase": phase, "op": op, "calls": calls, "nbytes": nbytes,
            "bytes_per_rank": calls * nbytes * bus_factor(op, n), "why": why}


def comm_theory_per_layer(batch_size: int, seq_len: int, hidden_size: int, tp: int, *,
                          sequence_parallel: bool = False, regather: bool = True, bytes_per_element: int = 4,
                          where: str = "layer") -> list[dict]:
    """Predicted collectives of one transformer layer, forward and backward (one row per phase and op).

    Each row: ``where``, ``phase`` (fwd/bwd), ``op``, ``calls``, ``nbytes`` (S per call, nccl-tests
    convention: S = B*T*H*bytes_per_element for every call here), ``bytes_per_rank`` (calls x S x ring factor:
    all-reduce 2(tp-1)/tp, all-gather / reduce-scatter (tp-1)/tp), ``why``.

    TP (Shoeybi et al. 2019, Figure 4): forward 2 all-reduces (``g`` after attention and after the MLP),
    backward 2 (``f`` before each). SP (Korthikanti et al. 2022, Section 4.2.2, Figure 5): each all-reduce
    becomes an all-gather + a reduce-scatter of the same S, so the same bytes per rank on a ring
    (2(tp-1)/tp = 2 x (tp-1)/tp); with ``regather`` the backward adds one all-gather per column region to
    rebuild the stored sequence shard. Raises ValueError for non-positive sizes.
    """
    s = (positive_int("batch_size", batch_size) * positive_int("seq_len", seq_len)
         * positive_int("hidden_size", hidden_size) * positive_int("bytes_per_element", bytes_per_element))
    n = positive_int("tp", tp)
    if not sequence_parallel:
        return [_row(where, "fwd", "all_reduce", 2, s, n, "g after the attention and after the MLP"),
                _row(where, "bwd", "all_reduce", 2, s, n, "f before the attention and before the MLP")]
    rows = [_row(where, "fwd", "all_gather", 2, s, n, "sequence -> whole before attention and MLP"),
            _row(where, "fwd", "reduce_scatter", 2, s, n, "partial sums -> sequence shard after attention, MLP"),
            _row(where, "bwd", "all_gather", 2 + (2 if regather else 0), s, n,
                 "transpose of the forward reduce-scatters" + (" + re-gather of the 2 stored input shards"
                                                              if regather else "")),
            _row(where, "bwd", "reduce_scatter", 2, s, n, "transpose of the forward all-gathers")]
    return rows


def comm_theory_model(spec: ModelSpec | str, batch_size: int, seq_len: int, tp: int, *,
                      sequence_parallel: bool = False, regather: bool = True, bytes_per_element: int = 4) -> list[dict]:
    """Predicted collectives of one training step (forward, vocab-parallel loss, backward, gradient
    finalisation) of :class:`TPTransformer`, with the ``where`` tags the model uses (``embed``, ``layer{i}``,
    ``head``, ``loss``, ``finalize``). Rows as :func:`comm_theory_per_layer`.

    Beyond the layers: the vocab-parallel embedding ends with ``g`` (SP: a reduce-scatter; its backward an
    all-gather); the column-parallel output layer starts with ``f`` (SP: all-gather, re-gathered in the
    backward); the loss exchanges 3 fp32 numbers per token in 2 all-reduces (max, then the (target logit,
    sum of exponentials) pair) instead of gathering B*T*V logits; :func:`finalize_grads` all-reduces the
    partial gradients (SP norms, row biases, learned positions; replicated kv heads) in one call.
    Raises ValueError as :func:`check_tp` (with the vocabulary padded) for a tp the model cannot use.
    """
    if isinstance(spec, str):
        spec = get_spec(spec)
    plan = check_tp(spec, tp, pad_vocab=True, sequence_parallel=sequence_parallel, seq_len=seq_len)
    n, e = plan["tp"], bytes_per_element
    s = batch_size * seq_len * spec.hidden_size * e
    rows = []
    if n == 1:
        return rows
    sp = sequence_parallel
    rows.append(_row("embed", "fwd", "reduce_scatter" if sp else "all_reduce", 1, s, n, "vocab-parallel embedding"))
    if sp:
        rows.append(_row("embed", "bwd", "all_gather", 1, s, n, "transpose of the embedding reduce-scatter"))
    for i in range(spec.n_layers):
        rows += comm_theory_per_layer(batch_size, seq_len, spec.hidden_size, n, sequence_parallel=sp,
                                      regather=regather, bytes_per_element=e, where=f"layer{i}")
    if sp:
        rows.append(_row("head", "fwd", "all_gather", 1, s, n, "sequence -> whole before the output layer"))
        if regather:
            rows.append(_row("head", "bwd", "all_gather", 1, s, n, "re-gather of the stored shard"))
        rows.append(_row("head", "bwd", "reduce_scatter", 1, s, n, "transpose of the forward all-gather"))
    else:
        rows.append(_row("head", "bwd", "all_reduce", 1, s, n, "f before the column-parallel output layer"))
    tokens = batch_size * seq_len
    loss_sizes = [tokens * 4, 2 * tokens * 4]  # fp32: the max, then the (target logit, sum exp) pair
    rows.append({"where": "loss", "phase": "fwd", "op": "all_reduce", "calls": 2, "nbytes": None,
                 "nbytes_list": loss_sizes, "bytes_per_rank": sum(loss_sizes) * 2 * (n - 1) / n,
                 "why": "max; (target logit, sum exp) pair: 3 numbers per token, not V"})
    fin = 0
    d, h = spec.head_dim, spec.hidden_size
    if sp:
        fin += spec.n_layers * 2 * spec.norm_params() + spec.norm_params()
        fin += spec.n_layers * 2 * h if spec.bias else 0
        fin += spec.max_seq_len * h if spec.position == "learned" else 0
    if plan["kv"] == "replicate":
        per_head = d * h + (d if spec.bias else 0)
        fin += spec.n_layers * 2 * spec.n_kv_heads * per_head
    if fin:
        rows.append(_row("finalize", "bwd", "all_reduce", 1, fin * e, n,
                         "partial gradients: " + ", ".join(
                             ([f"SP norms{' and biases' if spec.bias else ''}"] if sp else [])
                             + (["learned positions"] if sp and spec.position == "learned" else [])
                             + (["replicated kv heads"] if plan["kv"] == "replicate" else []))))
    return rows


def comm_theory_mlp_pair(kind: str, tokens: int, hidden_size: int, ffn_hidden_size: int, tp: int,
                         bytes_per_element: int = 4) -> list[dict]:
    """Collectives of a two-matmul MLP from a replicated input to a replicated output, forward + backward.

    ``"column-row"`` (Megatron): forward one all-reduce of the [tokens, H] output, backward one of the input
    gradient. ``"column-column"``: the second column layer needs the whole [tokens, F] activation, so the
    first output is all-gathered (the extra collective column->row avoids), then the second output too;
    backward: ``f`` before each column layer (2 all-reduces, the first of size [tokens, F]).
    Raises ValueError for an unknown kind.
    """
    check_choice("kind", kind, ("column-row", "column-column"))
    n = positive_int("tp", tp)
    sh = positive_int("tokens", tokens) * positive_int("hidden_size", hidden_size) * bytes_per_element
    sf = tokens * positive_int("ffn_hidden_size", ffn_hidden_size) * bytes_per_element
    if kind == "column-row":
        return [_row(kind, "fwd", "all_reduce", 1, sh, n, "g after the row layer"),
                _row(kind, "bwd", "all_reduce", 1, sh, n, "f before the column layer")]
    rows = [_row(kind, "fwd", "all_gather", 1, sf, n, "the second column layer needs the whole activation; "
                 "then the whole output"),
            _row(kind, "bwd", "all_reduce", 1, sf, n, "f before the second column layer; f before the first")]
    for row in rows:  # two calls of different sizes each: [tokens, F] and [tokens, H]
        per_byte = row["bytes_per_rank"] / sf
        row.update(calls=2, nbytes=None, nbytes_list=sorted([sf, sh]), bytes_per_rank=per_byte * (sf + sh))
    return rows


def comm_table(records) -> list[dict]:
    """Group CommLog records (``log.records`` or ``log.to_frame()`` rows) into rows like the theory's:
    ``where``, ``phase``, ``op``, ``calls``, ``nbytes`` (S per call; ``None`` when calls differ in size,
    with ``nbytes_list``), ``bytes_per_rank``; tags ``"where/phase"``."""
    groups: dict = {}
    for r in records:
        where, _, phase = r["tag"].partition("/")
        key = (where, phase or "bwd", r["op"])
        groups.setdefault(key, []).append(r)
    rows = []
    for (where, phase, op), rs in groups.items():
        sizes = [int(r["nbytes"]) for r in rs]
        row = {"where": where, "phase": phase, "op": op, "calls": len(rs),
               "nbytes": sizes[0] if len(set(sizes)) == 1 else None,
               "bytes_per_rank": float(sum(r["bytes_per_rank"] for r in rs))}
        if row["nbytes"] is None:
            row["nbytes_list"] = sorted(sizes)
        rows.append(row)
    return rows


def comm_vs_theory(records, theory: list[dict]) -> list[dict]:
    """Logged collectives (CommLog records: measured, what the code issued) beside predicted ones (theory
    rows), one row per (where, phase, op): ``calls_measured``, ``calls_predicted``, ``nbytes_measured``,
    ``nbytes_predicted`` (S per call, or the sorted list when calls differ), ``bytes_per_rank_model`` (the
    logged S x ring factor: a model of what a ring sends for those calls, not a measurement; what the sockets
    carried is in :func:`step_bytes_table`), ``bytes_per_rank_predicted``, ``match`` (calls and sizes equal)."""
    meas = {(r["where"], r["phase"], r["op"]): r for r in comm_table(records)}
    pred = {(r["where"], r["phase"], r["op"]): r for r in theory}

    def sizes(r):
        if r is None:
            return None
        return r["nbytes"] if r.get("nbytes") is not None else r.get("nbytes_list")

    order = list(pred) + [k for k in meas if k not in pred]
    rows = []
    for key in order:
        m, p = meas.get(key), pred.get(key)
        rows.append({"where": key[0], "phase": key[1], "op": key[2],
                     "calls_measured": m["calls"] if m else 0, "calls_predicted": p["calls"] if p else 0,
                     "nbytes_measured": sizes(m), "nbytes_predicted": sizes(p),
                     "bytes_per_rank_model": m["bytes_per_rank"] if m else 0.0,
                     "bytes_per_rank_predicted": p["bytes_per_rank"] if p else 0.0,
                     "match": m is not None and p is not None and m["calls"] == p["calls"] and sizes(m) == sizes(p)})
    return rows

# ------------------------------------------------------------------------------------------------------
# rank functions (launch(fn, world_size, ...))
# ------------------------------------------------------------------------------------------------------
def _perturb(model: nn.Module, seed: int = 1) -> nn.Module:
    """Give biases and norm weights non-trivial values (the same on every rank) so parity checks see them:
    the lab's init sets biases to 0 and norm weights to 1, which would hide a bias added tp times."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_((torch.randn(p.shape, generator=g) * 0.1).to(p.dtype))
    return model


def _compare(check: str, got, want, dtype=torch.float32, atol_extra: float = 0.0, **extra) -> dict:
    """One parity row: max abs error and pass/fail under TOLERANCES[dtype] (torch.testing.assert_close),
    ``atol_extra`` added to the absolute tolerance where a row states why."""
    tol = dict(TOLERANCES[dtype])
    tol["atol"] += atol_extra
    if isinstance(want, dict):
        pairs = [(k, got.get(k), v) for k, v in want.items()]
    else:
        pairs = [(check, got, want)]
    err, ok, msg = 0.0, True, ""
    for key, g, w in pairs:
        if g is None:
            ok, msg = False, f"{key}: missing"
            continue
        g, w = torch.as_tensor(g).detach().cpu().float(), torch.as_tensor(w).detach().cpu().float()
        if g.shape != w.shape:
            ok, msg = False, f"{key}: shape {tuple(g.shape)} != {tuple(w.shape)}"
            continue
        err = max(err, float((g - w).abs().max()) if g.numel() else 0.0)
        try:
            torch.testing.assert_close(g, w, **tol)
        except AssertionError as e:
            ok = False
            msg = msg or f"{key}: " + " ".join(str(e).split())[:300]
    return {"check": check, "max_abs_err": err, "rtol": tol["rtol"], "atol": tol["atol"], "ok": ok,
            "detail": msg, **extra}


def _seeded_linear(in_features: int, out_features: int, seed: int, device) -> nn.Linear:
    """An nn.Linear with the same weights and bias on every rank (nn.Linear's own init uses each rank's
    global RNG, which is exactly the sharding-dependent-init field case)."""
    lin = nn.Linear(in_features, out_features, device=device)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lin.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return lin


def _inputs(shape, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device)


def _block_parity(ctx, name: str, full: nn.Module, par: nn.Module, x: torch.Tensor, sp: bool, group=None) -> list:
    """Forward + backward of a block against its unsharded original: output, input gradient, weight grads."""
    n, r = tp_size(group), tp_rank(group)
    xr = x.clone().requires_grad_(True)
    yr = full(xr)
    w = _inputs(yr.shape, 99, x.device)
    (yr * w).sum().backward()
    xl = (x.chunk(n, SEQ_DIM)[r] if sp else x).clone().requires_grad_(True)
    yl = par(xl)
    wl = w.chunk(n, SEQ_DIM)[r] if sp else w
    (yl * wl).sum().backward()
    finalize_grads(par, group)
    want_y = yr.chunk(n, SEQ_DIM)[r] if sp else yr
    want_dx = xr.grad.chunk(n, SEQ_DIM)[r] if sp else xr.grad
    grads = gather_full(par, "grad", group)
    ref = {k: p.grad for k, p in full.named_parameters()}
    extra = {"tp": n, "sp": sp}
    return [_compare(f"{name}: output", yl, want_y, **extra),
            _compare(f"{name}: input grad", xl.grad, want_dx, **extra),
            _compare(f"{name}: weight grads", grads, ref, **extra)]


def _gathered_logits(logits: torch.Tensor, vocab_size: int, group=None) -> torch.Tensor:
    return _all_gather_dim(logits.detach(), -1, group)[..., :vocab_size]


def _model_parity(ctx, spec: ModelSpec, sp: bool, batch_size: int, seq_len: int, steps: int, lr: float,
                  seed: int, group=None) -> list:
    """The whole model: logits, loss, every gradient (step 0), then losses and weights over ``steps``
    AdamW steps, TP vs the unsharded reference built from the same full weights."""
    n = tp_size(group)
    ref = _perturb(build_model(spec, seed, device=ctx.device))
    tpm = apply_tp(_perturb(build_model(spec, seed, device=ctx.device)), group, sequence_parallel=sp, pad_vocab=True)
    data = SyntheticLM(spec.vocab_size, seq_len, seed)
    o_ref, o_tp = make_optimizer(ref.parameters(), lr), make_optimizer(tpm.parameters(), lr)
    label = f"model {spec.name}" + (f" (vocab {spec.vocab_size}, padded to {tpm.padded_vocab_size})"
                                    if tpm.padded_vocab_size != spec.vocab_size else "")
    extra = {"tp": n, "sp": sp}
    rows, l_ref, l_tp = [], [], []
    for step in range(steps):
        tokens, targets = (t.to(ctx.device) for t in data.batch(step, batch_size))
        o_ref.zero_grad(set_to_none=True)
        o_tp.zero_grad(set_to_none=True)
        logits_r = ref(tokens)
        loss_r = lm_loss(logits_r, targets)
        loss_r.backward()
        logits_t = tpm(tokens)
        loss_t = tpm.loss(logits_t, targets)
        loss_t.backward()
        finalize_grads(tpm, group)
        if step == 0:
            rows.append(_compare(f"{label}: logits", _gathered_logits(logits_t, spec.vocab_size, group), logits_r,
                                 **extra))
            rows.append(_compare(f"{label}: grads", gather_full(tpm, "grad", group),
                                 {k: p.grad for k, p in ref.named_parameters()}, **extra))
        l_ref.append(loss_r.item())
        l_tp.append(loss_t.item())
        o_ref.step()
        o_tp.step()
    rows.append(_compare(f"{label}: losses over {steps} AdamW steps", torch.tensor(l_tp), torch.tensor(l_ref),
                         **extra))
    # Adam divides each gradient by its running RMS: where a gradient is near eps=1e-8, a rounding-level
    # difference moves that element's update by up to lr, so weights get atol = 0.1 * lr * steps on top of
    # fp32's (a parameter left un-updated would still be off by ~lr per step).
    rows.append(_compare(f"{label}: weights after {steps} steps", gather_full(tpm, "param", group),
                         {k: p.detach() for k, p in ref.named_parameters()}, atol_extra=0.1 * lr * steps,
                         **extra))
    return rows


def _loss_parity(ctx, vocab_size: int, tokens: int, group=None) -> list:
    """The vocab-parallel loss alone (with padding when tp does not divide vocab_size): loss and logit grads."""
    n, r = tp_size(group), tp_rank(group)
    vp = pad_vocab_size(vocab_size, n)
    full = _inputs((tokens, vocab_size), 5, ctx.device) * 3
    targets = torch.randint(vocab_size, (tokens,), generator=torch.Generator().manual_seed(6)).to(ctx.device)
    fr = full.clone().requires_grad_(True)
    want = F.cross_entropy(fr, targets)
    want.backward()
    padded = torch.cat([full, torch.zeros(tokens, vp - vocab_size, device=ctx.device)], -1)
    local = padded.chunk(n, -1)[r].clone().requires_grad_(True)
    got = vocab_parallel_cross_entropy(local, targets, vocab_size, group)
    got.backward()
    want_g = torch.cat([fr.grad, torch.zeros(tokens, vp - vocab_size, device=ctx.device)], -1).chunk(n, -1)[r]
    label = f"vocab-parallel loss (V={vocab_size}, padded to {vp})"
    return [_compare(f"{label}: loss", got, want, tp=n, sp=False),
            _compare(f"{label}: logit grads", local.grad, want_g, tp=n, sp=False)]


def _field_cases(ctx, spec: ModelSpec, batch_size: int, seq_len: int, seed: int, group=None) -> list[dict]:
    """Reproduce the field cases and show what catches them. Each row: ``case``, ``what``, ``value``,
    ``caught`` (True when a check here detects or prevents it)."""
    n = tp_size(group)
    rows = []
    tol = TOLERANCES[torch.float32]
    # 1. Colwise -> GELU(tanh) -> Rowwise whose output differs: the row bias added on every rank, before g.
    full = _perturb(build_model(spec, seed, device=ctx.device)).layers[0].mlp
    x = _inputs((batch_size, seq_len, spec.hidden_size), 7, ctx.device)
    with torch.no_grad():
        want = full(x)
        par = ParallelMLP(full, group)
        good = par(x)
        h = F.gelu(F.linear(x, par.fc_in.weight, par.fc_in.bias), approximate="tanh")
        bad = _all_reduce(F.linear(h, par.fc_out.weight, par.fc_out.bias), group)
    rows.append({"case": "MLP: row bias added on every rank before the all-reduce",
                 "what": "max |out - reference|: bias-before-reduce vs RowParallelLinear",
                 "value": float((bad - want).abs().max()), "ours": float((good - want).abs().max()),
                 "caught": not torch.allclose(bad, want, **tol) and torch.allclose(good, want, **tol)})
    # 2. initialisation that depends on sharding: every rank draws its own shard with the same seed
    out_f, in_f = spec.ffn_hidden_size, spec.hidden_size
    torch.manual_seed(seed)
    own = nn.Linear(in_f, out_f // n, bias=False).weight.detach()
    per_shard = _all_gather_dim(own.unsqueeze(0), 0, group).reshape(out_f, in_f)
    torch.manual_seed(seed)
    tp1 = nn.Linear(in_f, out_f, bias=False).weight.detach()
    col = ColumnParallelLinear(in_f, out_f, bias=False, group=group, seed=seed)
    master = _all_gather_dim(col.weight.detach().unsqueeze(0), 0, group).reshape(out_f, in_f)
    rows.append({"case": "initialisation per shard (every rank seeds its own shard)",
                 "what": "max |full weight at tp - full weight at tp=1|: per-shard init vs master-weight init",
                 "value": float((per_shard - tp1).abs().max()) if n > 1 else 0.0,
                 "ours": float((master - _master_weight(out_f, in_f, seed, 0.02)).abs().max()),
                 "caught": True})
    # 3. a row-parallel output layer feeding a vocab-parallel loss
    model = _perturb(build_model(spec.replace(tied_embeddings=False), seed, device=ctx.device))
    tokens, targets = (t.to(ctx.device) for t in SyntheticLM(spec.vocab_size, seq_len, seed).batch(0, batch_size))
    with torch.no_grad():
        hidden = model.norm(model.embed_tokens(tokens))  # the layers do not matter for this case
        want_loss = float(lm_loss(model.lm_head(hidden), targets))
        row_head = RowParallelLinear.from_linear(model.lm_head, group, input_is_parallel=False)
        logits = row_head(hidden)
        silent = float(_unchecked_vocab_parallel_ce(logits.clone(), targets, group))
        try:
            vocab_parallel_cross_entropy(logits, targets, spec.vocab_size, group)
            err = None
        except ValueError as e:
            err = str(e)
        try:
            vocab_parallel_cross_entropy(logits.clone(), targets, spec.vocab_size, group)  # layout tag lost
            err2 = None
        except ValueError as e:
            err2 = str(e)
    rows.append({"case": "row-parallel output layer -> vocab-parallel loss",
                 "what": f"shape-trusting loss {silent:.4f} vs reference {want_loss:.4f} (no error)",
                 "value": abs(silent - want_loss), "ours": err, "ours_untagged": err2,
                 "caught": err is not None and err2 is not None})
    return rows


def count_model_collectives(ctx, spec: ModelSpec, batch_size: int, seq_len: int, *, sequence_parallel: bool,
                            regather: bool = True, seed: int = 0, label: str = "TP", group=None,
                            socket: dict | None = None) -> list[dict]:
    """Every collective of one TP training step (forward, loss, backward, finalize), as CommLog records
    (``op``, ``nbytes``, ``bytes_per_rank``, ``tag``=``where/phase``...). Also adds them, and the
    ``{label} forward`` / ``{label} backward`` spans, to ``ctx.timeline``. With ``socket`` (a dict), stores
    ``socket["bytes"]``: the bytes this process wrote during the step, measured
    (:func:`labkit.runtime.probes.socket_bytes_written`; gloo's socket sends, None on CUDA or without
    /proc/self/io)."""
    from labkit.runtime.probes import socket_bytes_written

    tpm = apply_tp(build_model(spec, seed, device=ctx.device), group, sequence_parallel=sequence_parallel,
                   pad_vocab=True, regather=regather)
    tokens, targets = (t.to(ctx.device) for t in SyntheticLM(spec.vocab_size, seq_len, seed).batch(0, batch_size))
    ctx.barrier()
    before = None if ctx.device.type == "cuda" else socket_bytes_written()
    with CommLog(ctx) as log:
        tpm.commlog = log
        with ctx.timer(f"{label} forward", barrier=True):
            logits = tpm(tokens)
            loss = tpm.loss(logits, targets)
        with ctx.timer(f"{label} backward"):
            loss.backward()
        tpm.end_tags()
        with log.tagged("finalize/bwd"):
            finalize_grads(tpm, group)
    after = socket_bytes_written() if before is not None else None
    if socket is not None:
        socket["bytes"] = None if after is None else after - before
    tpm.commlog = None
    return [{k: v for k, v in r.items() if k not in ("start_ns", "end_ns")} for r in log.records]


def count_mlp_pair_collectives(ctx, kind: str, tokens: int, hidden_size: int, ffn_hidden_size: int,
                               group=None) -> list[dict]:
    """Collectives of a GELU MLP built as column->row or column->column (see :func:`comm_theory_mlp_pair`),
    forward + backward, checked against the unsharded MLP (records plus a ``parity_ok`` flag on each).
    Raises ValueError for an unknown kind."""
    check_choice("kind", kind, ("column-row", "column-column"))
    dev = torch.device("cpu") if ctx is None else ctx.device
    l1 = _seeded_linear(hidden_size, ffn_hidden_size, 3, dev)
    l2 = _seeded_linear(ffn_hidden_size, hidden_size, 4, dev)
    x = _inputs((tokens, hidden_size), 4, dev).requires_grad_(True)
    want = l2(F.gelu(l1(x), approximate="tanh"))
    c1 = ColumnParallelLinear.from_linear(l1, group, gather_output=kind == "column-column")
    c2 = (RowParallelLinear.from_linear(l2, group) if kind == "column-row"
          else ColumnParallelLinear.from_linear(l2, group, gather_output=True))
    with CommLog(ctx) as log:
        with log.tagged(f"{kind}/fwd"):
            y = c2(F.gelu(c1(x), approximate="tanh"))
        with log.tagged(f"{kind}/bwd"):
            y.sum().backward()
    ok = torch.allclose(y.detach(), want.detach(), **TOLERANCES[torch.float32])
    return [{**{k: v for k, v in r.items() if k not in ("start_ns", "end_ns")}, "parity_ok": ok} for r in log.records]


def activation_bytes(ctx, spec: ModelSpec, batch_size: int, seq_len: int, seed: int = 0, group=None) -> list[dict]:
    """Bytes autograd saves for the backward during one forward + loss, per rank, measured with
    :class:`labkit.runtime.measure.SavedActivations` (saved-tensor hooks, each storage once, parameters excluded): the
    unsharded model (tp=1), TP, TP+SP with the re-gather, TP+SP storing the gathered linear inputs.
    Rows: ``variant``, ``tp``, ``bytes`` (total), ``per_layer`` (bytes first saved inside each layer),
    ``outside_layers`` (embedding, final norm, head, loss).

    Prediction to set beside it (Korthikanti et al. 2022, Table 2): per layer sbh(34 + 5as/h) unsharded,
    sbh(10 + 24/t + 5as/ht) with TP (the norms, residuals and linear-layer inputs stay whole), sbh(34/t +
    5as/ht) with TP+SP: everything 1/t, so TP+SP ~= (tp=1 bytes) / tp."""
    n = tp_size(group)
    tokens, targets = (t.to(ctx.device) for t in SyntheticLM(spec.vocab_size, seq_len, seed).batch(0, batch_size))
    from labkit.runtime.measure import SavedActivations

    def row(variant, tp_degree, acts):
        return {"variant": variant, "tp": tp_degree, "bytes": acts.total_bytes, "per_layer": acts.per_layer,
                "outside_layers": acts.total_bytes - sum(acts.per_layer)}

    ref = build_model(spec, seed, device=ctx.device)
    with SavedActivations(ref, keep_items=False) as acts:
        loss = lm_loss(ref(tokens), targets)
    rows = [row("tp=1 (unsharded)", 1, acts)]
    del loss
    for label, sp, regather in (("TP", False, True), ("TP+SP", True, True), ("TP+SP, no re-gather", True, False)):
        tpm = apply_tp(build_model(spec, seed, device=ctx.device), group, sequence_parallel=sp, pad_vocab=True,
                       regather=regather)
        with SavedActivations(tpm, keep_items=False) as acts:
            loss = tpm.loss(tpm(tokens), targets)
        rows.append(row(label, n, acts))
        del loss, tpm
    return rows


def activation_vs_theory(rows: list[dict], spec: ModelSpec | str, batch_size: int, seq_len: int) -> list[dict]:
    """Measured saved-activation bytes (:func:`activation_bytes` rows) beside labkit.theory.memory's prediction for
    the lab model (``activation_model="lab"``, fp32, CPU kernels; ``ParallelConfig(tp, sequence_parallel)``):
    per layer and in total (layers + embedding/head/loss items). The prediction assumes SP stores the
    linear-layer inputs as sequence shards (the re-gather); without it each column region (attention's
    wq/wk/wv and the MLP's input linears in every layer, and the output layer) stores the gathered input
    [B, T, H] instead of its shard [B, T/tp, H], so "no re-gather" is predicted as TP+SP plus
    B·T·H·bytes·(1 - 1/tp) per region (Korthikanti et al. 2022, Section 4.2.2: storing the shard is what the
    extra all-gather buys). Adds ``per_layer_measured``, ``per_layer_predicted``, ``total_predicted``,
    ``ratio_to_tp1_measured``. Raises ValueError for an unknown model or bad sizes."""
    from labkit.theory import memory as mem

    if isinstance(spec, str):
        spec = get_spec(spec)
    train = mem.TrainConfig(micro_batch_size=batch_size, seq_len=seq_len, convention="torch-fp32", kernels="cpu")
    full = next(r["bytes"] for r in rows if r["tp"] == 1)
    out = []
    e = train.act_bits() // 8
    for r in rows:
        sp = r["variant"].startswith("TP+SP")
        par = mem.ParallelConfig(tp=r["tp"], sequence_parallel=sp)
        pred_layer = mem.activation_bytes_per_layer(spec, train, par)
        pred_total = spec.n_layers * pred_layer + sum(i.nbytes for i in mem.edge_activation_items(spec, train, par))
        if "no re-gather" in r["variant"]:
            gathered = batch_size * seq_len * spec.hidden_size * e * (r["tp"] - 1) // r["tp"]  # per column region
            pred_layer += 2 * gathered
            pred_total += (2 * spec.n_layers + 1) * gathered
        out.append({"variant": r["variant"], "tp": r["tp"], "per_layer_measured": r["per_layer"][0],
                    "per_layer_predicted": pred_layer, "total_measured": r["bytes"], "total_predicted": pred_total,
                    "ratio_to_tp1_measured": r["bytes"] / full})
    return out


def dtensor_parity_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """The model the DTensor parity check runs: ``spec`` itself, or, when tp does not divide its kv heads
    (DTensor's ColwiseParallel cannot replicate them), the same model with n_kv_heads = tp."""
    return spec.replace(n_kv_heads=tp, name=f"{spec.name}, n_kv_heads={tp}") if spec.n_kv_heads % tp else spec


def _dtensor_parity(ctx, spec: ModelSpec, sp: bool, batch_size: int, seq_len: int, seed: int) -> list:
    n = dist.get_world_size()
    spec = dtensor_parity_spec(spec, n)
    ref = _perturb(build_model(spec, seed, device=ctx.device))
    m = apply_dtensor_tp(_perturb(build_model(spec, seed, device=ctx.device)), sequence_parallel=sp)
    tokens, targets = (t.to(ctx.device) for t in SyntheticLM(spec.vocab_size, seq_len, seed).batch(0, batch_size))
    logits_r = ref(tokens)
    lm_loss(logits_r, targets).backward()
    logits = m(tokens)
    loss = dtensor_loss(logits, targets)
    _dtensor_backward(loss)
    grads = {k: _full(p.grad) for k, p in m.named_parameters()}
    extra = {"tp": n, "sp": sp}
    return [_compare(f"DTensor {spec.name}: logits", _full(logits), logits_r, **extra),
            _compare(f"DTensor {spec.name}: loss", _full(loss), lm_loss(logits_r.detach(), targets), **extra),
            _compare(f"DTensor {spec.name}: grads", grads, {k: p.grad for k, p in ref.named_parameters()}, **extra)]


#: the training steps whose collectives tp_check_rank counts: (key, label, sequence_parallel, regather)
COMM_RUNS = (("tp", "TP", False, True), ("sp", "TP+SP", True, True), ("sp_no_regather", "TP+SP (no re-gather)", True,
                                                                       False))


def step_bytes_table(check: dict) -> list[dict]:
    """Bytes one rank sends in one training step of each :data:`COMM_RUNS` variant, from a
    :func:`tp_check_rank` result, each number labelled with its source: ``payload S (measured: what the code
    issued)`` (CommLog), ``ring bytes (model: S x factor)``, ``ring bytes (predicted: comm_theory_model)``,
    ``gloo model`` (S x the factors of gloo's CPU algorithms: :data:`labkit.parallel.harness.GLOO_FACTORS`),
    ``socket bytes written (measured: gloo)`` (NaN where not measurable) and ``measured / gloo model``."""
    from labkit.experiments.common import GLOO_FACTORS

    spec = get_spec(check["spec"])
    rows = []
    for key, label, sp, regather in COMM_RUNS:
        recs = check["comm"][key]
        theory = comm_theory_model(spec, check["batch_size"], check["seq_len"], check["tp"], sequence_parallel=sp,
                                   regather=regather)
        gloo = sum(r["nbytes"] * GLOO_FACTORS[r["op"]](r["group_size"]) for r in recs)
        sock = check.get("socket_bytes", {}).get(key)
        sock = float("nan") if sock is None else float(sock)
        rows.append({"variant": label, "payload S (measured: what the code issued)": sum(r["nbytes"] for r in recs),
                     "ring bytes (model: S x factor)": sum(r["bytes_per_rank"] for r in recs),
                     "ring bytes (predicted: comm_theory_model)": sum(r["bytes_per_rank"] for r in theory),
                     "gloo model": gloo, "socket bytes written (measured: gloo)": sock,
                     "measured / gloo model": sock / gloo if gloo else float("nan")})
    return rows


def tp_check_rank(ctx, spec_name: str = "lab-tiny-llama", gelu_spec_name: str = "lab-tiny-gpt", *,
                  batch_size: int = 2, seq_len: int = 16, steps: int = 2, lr: float = 1e-3, seed: int = 0,
                  dtensor=True, activations: bool = True) -> dict:
    """Everything chapter 05 and tests/test_tensor_parallel.py check, in one launch (tp = world size):

    * ``parity``: rows (check, tp, sp, max_abs_err, rtol, atol, ok, detail) — column and row linear, GELU(tanh)
      MLP and SwiGLU MLP, GQA attention (kv heads split or replicated), each with and without SP; the whole
      model (Llama-style with a padded vocabulary, GPT-style with tied embeddings, each TP and TP+SP): logits,
      loss, every gradient, losses and weights over ``steps`` AdamW steps; the vocab-parallel loss with
      padding; the DTensor variant (TP and TP+SP). When ``spec_name == gelu_spec_name`` a case that would
      repeat another (same model, same SP flag) runs once. fp32, tolerances from ``labkit.models.TOLERANCES``.
    * ``comm``: {"tp": records, "sp": records, "sp_no_regather": records} of one training step of
      ``spec_name`` (CommLog, tagged ``where/phase``), to compare with :func:`comm_theory_model`;
      ``socket_bytes``: {same keys: bytes this rank wrote to gloo's sockets during that step (measured), or
      None}; :func:`step_bytes_table` puts them side by side;
    * ``comm_pair``: records of column->row and column->column MLPs;
    * ``field``: the reproduced field cases (:func:`_field_cases`);
    * ``activations``: saved-activation bytes per rank (:func:`activation_bytes`).
    ``dtensor``: True runs the DTensor parity check without and with SP, False skips it, or a tuple of SP
    flags to run (:func:`check_chapter` decides which the model allows).
    All ranks return the same (rank 0's numbers suffice). Raises ValueError for world_size < 2 or bad sizes,
    or a DTensor check the model does not allow (before any work).
    """
    spec, gspec = get_spec(spec_name), get_spec(gelu_spec_name)
    n = positive_int("world_size", ctx.world_size, minimum=2)  # tp=1 has nothing to split
    for s in (spec, gspec):
        check_tp(s, n, pad_vocab=True, sequence_parallel=True, seq_len=seq_len)
    dtensor_sp = (False, True) if dtensor is True else (() if dtensor is False else tuple(dtensor))
    for sp in dtensor_sp:
        check_tp(dtensor_parity_spec(spec, n), n, sequence_parallel=sp, seq_len=seq_len, dtensor=True)
    t0 = time.perf_counter()
    out: dict = {"tp": n, "spec": spec_name, "gelu_spec": gelu_spec_name, "batch_size": batch_size,
                 "seq_len": seq_len}
    parity = []
    dev = ctx.device
    h = spec.hidden_size
    sections: dict[str, float] = {}
    last = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        sections[name] = now - last[0]
        last[0] = now

    # one linear layer, split by columns and by rows
    lin = _seeded_linear(h, 2 * h, 21, dev)
    x = _inputs((batch_size, seq_len, h), 11, dev)
    parity += _block_parity(ctx, "linear, column-parallel (gathered output)", lin,
                            ColumnParallelLinear.from_linear(lin, gather_output=True), x, False)
    lin2 = _seeded_linear(2 * h, h, 22, dev)
    x2 = _inputs((batch_size, seq_len, 2 * h), 12, dev)
    parity += _block_parity(ctx, "linear, row-parallel (scattered input)", lin2,
                            RowParallelLinear.from_linear(lin2, input_is_parallel=False), x2, False)
    for sp in (False, True):
        gfull = _perturb(build_model(gspec, seed, device=dev)).layers[0].mlp
        parity += _block_parity(ctx, "MLP column -> GELU(tanh) -> row", gfull,
                                ParallelMLP(copy_module(gfull), sequence_parallel=sp), x, sp)
        if spec != gspec:  # the same model twice (model == gelu_model) would repeat the GELU rows
            sfull = _perturb(build_model(spec, seed, device=dev)).layers[0].mlp
            label = "MLP SwiGLU" if spec.mlp == "swiglu" else f"MLP {spec.mlp} ({spec_name})"
            parity += _block_parity(ctx, label, sfull, ParallelMLP(copy_module(sfull), sequence_parallel=sp), x, sp)
        afull = _perturb(build_model(spec, seed, device=dev)).layers[0].attn
        plan = kv_plan(spec.n_heads, spec.n_kv_heads, n)
        parity += _block_parity(ctx, f"attention GQA ({spec.n_heads} q / {spec.n_kv_heads} kv heads, kv {plan})",
                                afull, ParallelAttention(copy_module(afull), spec.n_heads, spec.n_kv_heads,
                                                         sequence_parallel=sp), x, sp)
    lap("linear, MLP, attention")
    parity += _loss_parity(ctx, 255, batch_size * seq_len)
    padded_spec = spec.replace(vocab_size=spec.vocab_size - 3)
    model_cases: list = []
    for case in ((spec, False), (padded_spec, True), (gspec, False), (gspec, True)):
        if case not in model_cases:  # model == gelu_model: its TP case runs once
            model_cases.append(case)
    for s, sp in model_cases:
        parity += _model_parity(ctx, s, sp, batch_size, seq_len, steps, lr, seed)
    lap("loss, whole models")
    for sp in dtensor_sp:
        parity += _dtensor_parity(ctx, spec, sp, batch_size, seq_len, seed)
    lap("DTensor")
    out["parity"] = parity
    out["comm"], out["socket_bytes"] = {}, {}
    for key, label, sp, regather in COMM_RUNS:
        sock: dict = {}
        out["comm"][key] = count_model_collectives(ctx, spec, batch_size, seq_len, sequence_parallel=sp,
                                                   regather=regather, seed=seed, label=label, socket=sock)
        out["socket_bytes"][key] = sock["bytes"]
    out["comm_pair"] = (count_mlp_pair_collectives(ctx, "column-row", batch_size * seq_len, h, spec.ffn_hidden_size)
                        + count_mlp_pair_collectives(ctx, "column-column", batch_size * seq_len, h,
                                                     spec.ffn_hidden_size))
    lap("counted collectives")
    out["field"] = _field_cases(ctx, gspec, batch_size, seq_len, seed)
    lap("field cases")
    if activations:
        out["activations"] = activation_bytes(ctx, spec, batch_size, seq_len, seed)
    lap("activation bytes")
    out["section_s"] = sections
    out["seconds"] = time.perf_counter() - t0
    return out


def copy_module(m: nn.Module) -> nn.Module:
    """A deep copy (the TP wrappers reuse and replace submodules; keep the reference intact)."""
    import copy

    return copy.deepcopy(m)


STEP_VARIANTS = ("tp1", "hand", "hand_sp", "dtensor", "dtensor_sp")


def _check_step_variants(spec: ModelSpec, tp: int, variants, seq_len: int) -> None:
    for v in variants:
        check_choice("variant", v, STEP_VARIANTS)
        if v != "tp1":
            check_tp(spec, tp, sequence_parallel=v.endswith("_sp"), seq_len=seq_len, dtensor=v.startswith("dtensor"),
                     pad_vocab=v.startswith("hand"))


def step_time_rank(ctx, spec_name: str = "lab-tiny-llama", variants=("tp1", "hand", "dtensor"), *,
                   batch_size: int = 4, seq_len: int = 64, steps: int = 5, warmup: int = 2, lr: float = 1e-3,
                   seed: int = 0) -> dict:
    """Measured training-step time (forward, loss, backward, finalize, AdamW) of several variants of the same
    model in the same run, interleaved step by step so machine load hits them alike.

    Variants: ``tp1`` (the unsharded model on rank 0 alone; the other ranks wait), ``hand`` / ``hand_sp``
    (:func:`apply_tp`, without / with sequence parallelism), ``dtensor`` / ``dtensor_sp``
    (:func:`apply_dtensor_tp`). Every step starts after a barrier and ends after one (the step is done when
    the slowest rank is). Returns ``{"step_s": {variant: [seconds per measured step]}, "losses": {variant:
    [...]}, "tp", "spec", ...}``; the timeline gets a ``{variant} step`` span per step.
    Raises ValueError for an unknown variant or a spec the variant cannot run (before any step).
    """
    spec = get_spec(spec_name)
    n = ctx.world_size
    _check_step_variants(spec, n, variants, seq_len)
    steps, warmup = positive_int("steps", steps), positive_int("warmup", warmup, minimum=0)
    data = SyntheticLM(spec.vocab_size, seq_len, seed)
    models = {}
    for v in variants:
        if v == "tp1":
            m = build_model(spec, seed, device=ctx.device) if ctx.rank == 0 else None
        elif v.startswith("hand"):
            m = apply_tp(build_model(spec, seed, device=ctx.device), sequence_parallel=v == "hand_sp", pad_vocab=True)
        else:
            m = apply_dtensor_tp(build_model(spec, seed, device=ctx.device), sequence_parallel=v == "dtensor_sp")
        models[v] = (m, make_optimizer(m.parameters(), lr) if m is not None else None)
    times: dict = {v: [] for v in variants}
    losses: dict = {v: [] for v in variants}
    for step in range(warmup + steps):
        tokens, targets = (t.to(ctx.device) for t in data.batch(step, batch_size))
        for v in variants:
            m, opt = models[v]
            ctx.barrier()
            t0 = time.perf_counter()
            with ctx.timeline.span(f"{v} step", "compute", step=step):
                if m is not None:
                    opt.zero_grad(set_to_none=True)
                    if v == "tp1":
                        loss = lm_loss(m(tokens), targets)
                        loss.backward()
                    elif v.startswith("hand"):
                        loss = m.loss(m(tokens), targets)
                        loss.backward()
                        finalize_grads(m)
                    else:
                        loss = dtensor_loss(m(tokens), targets)
                        _dtensor_backward(loss)
                    opt.step()
                    losses[v].append(float(_full(loss)))
                ctx.barrier()
            if step >= warmup:
                times[v].append(time.perf_counter() - t0)
    return {"step_s": times, "losses": losses, "tp": n, "spec": spec_name, "batch_size": batch_size,
            "seq_len": seq_len, "steps": steps, "warmup": warmup, "threads": torch.get_num_threads()}


def step_time_findings(step_s: dict, tp: int, *, near: float = 0.1) -> str:
    """What chapter 05's step-time run showed, as sentences computed from it (nothing assumed).

    ``step_s``: ``{variant: [seconds per measured step]}`` from :func:`step_time_rank` with a ``"tp1"`` entry;
    ``tp``: the degree the other variants ran at. Compares each variant's median step time with tp = 1's:
    speedup = median(tp1) / median(variant). Within ``near`` (10 %) of 1 it says "about as fast"; below, that
    on this run the collectives cost more than the arithmetic TP split; above, that the split arithmetic
    outweighed them. Raises ValueError when ``step_s`` has no ``"tp1"`` entry, a variant has no times, or
    ``tp`` < 2."""
    tp = positive_int("tp", tp, minimum=2)
    if "tp1" not in step_s:
        raise ValueError(f"step_s has variants {sorted(step_s)}; expected a 'tp1' entry to compare against")
    empty = [v for v, t in step_s.items() if not len(t)]
    if empty:
        raise ValueError(f"step_s has no measured steps for {empty}; every variant needs at least one")

    def median(t):
        return sorted(t)[len(t) // 2]

    base = median(step_s["tp1"])
    parts, slower, faster = [], [], []
    for v, t in step_s.items():
        if v == "tp1":
            continue
        speedup = base / median(t)
        parts.append(f"{v} {median(t) * 1e3:.1f} ms ({speedup:.2f}x)")
        (slower if speedup < 1 - near else faster if speedup > 1 + near else []).append(v)
    text = (f"Measured median step time: tp1 {base * 1e3:.1f} ms; at tp={tp}: " + ", ".join(parts)
            + " (speedup vs tp1 in brackets).")
    if slower:
        text += (f" {', '.join(slower)} ran slower than one rank: in this run the collectives TP adds to every "
                 "layer cost more than the arithmetic it split.")
    if faster:
        text += f" {', '.join(faster)} ran faster than one rank: the split arithmetic outweighed the collectives."
    about = [v for v in step_s if v != "tp1" and v not in slower and v not in faster]
    if about:
        text += f" {', '.join(about)} ran about as fast as one rank (within {near:.0%})."
    return text


def check_chapter(*, world_size, model: str = "lab-tiny-llama", gelu_model: str = "lab-tiny-gpt", batch_size=2,
                  seq_len=16, train_steps=2, time_batch_size=4, time_seq_len=64, time_steps=3,
                  timeout_s=300.0) -> dict:
    """Chapter 05's parameters, all checked before any launch, and which variants this model allows.

    Checks (ValueError naming the value and the fix): world_size >= 2 (tp = world_size; tp=1 splits nothing);
    known, dense, CPU-sized models; ``gelu_model`` a GELU MLP with biases (the field cases need a row bias);
    :func:`check_tp` for both models at tp (heads, kv heads split or replicated, ffn, vocabulary padded, SP
    with ``seq_len`` and ``time_seq_len``); sequence lengths within ``max_seq_len``; positive sizes, steps
    and ``timeout_s``.

    DTensor limits are decided here, not discovered in the ranks: the DTensor variant (``apply_dtensor_tp``)
    cannot replicate kv heads (tp must divide n_kv_heads; the parity check then uses a model with
    n_kv_heads = tp, :func:`dtensor_parity_spec`), cannot hold tied embeddings, does not pad the vocabulary,
    and with SP runs RoPE models only (learned positions). Each DTensor variant the model cannot run is
    skipped, with the reason.

    Returns ``{"world_size", "dtensor_parity": SP flags to check (for ``tp_check_rank(dtensor=...)``),
    "time_variants": (...), "skipped": {variant: reason}}``.
    """
    n = check_world_size("05", world_size, why="tensor parallelism splits each layer over world_size "
                                 "ranks, and tp=1 splits nothing")
    spec, gspec = get_spec(model), get_spec(gelu_model)
    for s in (spec, gspec):
        if s.is_moe:
            raise ValueError(f"model {s.name!r} is a mixture-of-experts model; chapter 05 splits dense layers "
                             "(expert parallelism is chapter 08): use lab-tiny-llama or lab-tiny-gpt")
    if gspec.mlp != "gelu" or not gspec.bias:
        raise ValueError(f"gelu_model={gelu_model!r} must be a GELU model with biases (the field cases add a row "
                         "bias on every rank); use gelu_model='lab-tiny-gpt'")
    batch_size, time_batch_size = positive_int("batch_size", batch_size), positive_int("time_batch_size",
                                                                                         time_batch_size)
    positive_int("train_steps", train_steps)
    positive_int("time_steps", time_steps)
    positive_float("timeout_s", timeout_s)
    for name, t in (("seq_len", seq_len), ("time_seq_len", time_seq_len)):
        for s in (spec, gspec):
            s.check_seq_len(t, name)
    try:
        for s in (spec, gspec):
            check_tp(s, n, pad_vocab=True, sequence_parallel=True, seq_len=seq_len)
        check_tp(spec, n, pad_vocab=True, sequence_parallel=True, seq_len=time_seq_len)
    except ValueError as e:
        raise ValueError(f"world_size={n} is the tp degree in chapter 05: {e}") from None
    check_fits_in_memory(spec, n, copies=4, what="chapter 05")
    skipped: dict[str, str] = {}
    parity = []
    for sp in (False, True):
        label = "DTensor parity, TP+SP" if sp else "DTensor parity, TP"
        try:
            check_tp(dtensor_parity_spec(spec, n), n, sequence_parallel=sp, seq_len=seq_len, dtensor=True)
            parity.append(sp)
        except ValueError as e:
            skipped[label] = str(e)
    time_variants = ["tp1", "hand", "hand_sp"]
    try:
        check_tp(spec, n, seq_len=time_seq_len, dtensor=True)
        time_variants.append("dtensor")
    except ValueError as e:
        skipped["DTensor step time"] = str(e)
    return {"world_size": n, "dtensor_parity": tuple(parity), "time_variants": tuple(time_variants),
            "skipped": skipped}


def chapter_rank(ctx, spec_name: str = "lab-tiny-llama", gelu_spec_name: str = "lab-tiny-gpt", *,
                 batch_size: int = 2, seq_len: int = 16, steps: int = 2, time_variants=("tp1", "hand", "hand_sp"),
                 time_batch_size: int = 4, time_seq_len: int = 64, time_steps: int = 3, seed: int = 0,
                 dtensor_parity=(False, True)) -> dict:
    """Chapter 05 in one launch (a launch costs seconds on a 2-core machine): ``{"check":``
    :func:`tp_check_rank` ``, "timed":`` :func:`step_time_rank` ``}``. ``dtensor_parity`` and
    ``time_variants`` come from :func:`check_chapter`. Raises ValueError (before any work) for a variant the
    model cannot run."""
    _check_step_variants(get_spec(spec_name), ctx.world_size, time_variants, time_seq_len)
    check = tp_check_rank(ctx, spec_name, gelu_spec_name, batch_size=batch_size, seq_len=seq_len, steps=steps,
                          seed=seed, dtensor=dtensor_parity)
    timed = step_time_rank(ctx, spec_name, time_variants, batch_size=time_batch_size, seq_len=time_seq_len,
                           steps=time_steps, warmup=1, seed=seed)
    return {"check": check, "timed": timed}
