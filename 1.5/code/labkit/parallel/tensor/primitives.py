"""The communication primitives of tensor and sequence parallelism, as autograd functions (Megatron-LM names).

Shapes: B batch, T sequence, H hidden, tp the group size, K any last dimension split over the group.

* ``f`` = :func:`copy_to_tp_region`: identity forward, all-reduce backward (enter a column-parallel region);
* ``g`` = :func:`reduce_from_tp_region`: all-reduce forward, identity backward (leave a row-parallel region)
  (Shoeybi et al. 2019, "Megatron-LM", Section 3, Figure 3);
* :func:`gather_from_tp_region` / :func:`scatter_to_tp_region`: the last dim gathered / split;
* sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models", Section 4.2.2, Figure 5): :func:`gather_from_sp_region` (``g``: all-gather forward, reduce-scatter
  backward), :func:`reduce_scatter_to_sp_region` (``g-bar``: reduce-scatter forward, all-gather backward),
  :func:`scatter_to_sp_region`;
* :func:`column_region`: several column-parallel linears entered once (Megatron's fused QKV), with the
  SP variant that stores only the sequence shard and re-gathers it in the backward (:class:`_SPColumnRegion`).

Each function stamps the layout of its output (:func:`tp_layout`), so a consumer can refuse the wrong one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.checks import check_choice, check_divides
from labkit.parallel.comm import all_gather_tensor, reduce_scatter_tensor

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
    x = x.contiguous()  # (..., k, ...): k = x.shape[dim]
    out = torch.empty((n,) + tuple(x.shape), dtype=x.dtype, device=x.device)  # (n, ..., k, ...)
    all_gather_tensor(out.view(-1), x.view(-1), group=group)
    return out.movedim(0, dim).flatten(dim, dim + 1)  # (..., n*k, ...)


def _reduce_scatter_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's ``1/n`` chunk along ``dim``. One reduce-scatter of
    x.nbytes bytes."""
    n = tp_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    check_divides("tp", n, f"size of dim {dim}", x.shape[dim])
    chunks = x.unflatten(dim, (n, x.shape[dim] // n)).movedim(dim, 0).contiguous()  # (n, ..., K/n, ...)
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)  # (..., K/n, ...)
    reduce_scatter_tensor(out.view(-1), chunks.view(-1), group=group)
    return out


def _split_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's ``1/n`` chunk of ``x`` along ``dim`` (no communication)."""
    n = tp_size(group)
    if n == 1:
        return x
    check_divides("tp", n, f"size of dim {dim % x.dim()}", x.shape[dim])
    return x.chunk(n, dim)[tp_rank(group)].contiguous()  # (..., K/n, ...)


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if tp_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)  # in place, shape unchanged
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
        return x.view_as(x)  # (B, T, H) replicated -> (B, T, H)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.contiguous(), ctx.group), None  # (B, T, H) partial -> (B, T, H) summed


class _ReduceFromTPRegion(torch.autograd.Function):
    """``g``: all-reduce forward, identity backward (Megatron ``reduce_from_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.contiguous().clone(), group)  # (B, T, H) partial -> (B, T, H) summed

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # (B, T, H)


class _GatherFromTPRegion(torch.autograd.Function):
    """All-gather along the last dim forward, keep own chunk backward
    (Megatron ``gather_from_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_dim(x, -1, group)  # (..., K/tp) -> (..., K)

    @staticmethod
    def backward(ctx, grad):
        return _split_dim(grad, -1, ctx.group), None  # (..., K) -> (..., K/tp)


class _ScatterToTPRegion(torch.autograd.Function):
    """Keep own chunk of the last dim forward, all-gather backward
    (Megatron ``scatter_to_tensor_model_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_dim(x, -1, group)  # (..., K) -> (..., K/tp)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, -1, ctx.group), None  # (..., K/tp) -> (..., K)


class _GatherFromSPRegion(torch.autograd.Function):
    """All-gather along the sequence forward, reduce-scatter backward (Korthikanti et al. 2022, ``g``
    in Figure 5; Megatron ``gather_from_sequence_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _all_gather_dim(x, dim, group)  # (B, T/tp, H) -> (B, T, H)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim(grad, ctx.dim, ctx.group), None, None  # (B, T, H) -> (B, T/tp, H)


class _ReduceScatterToSPRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence forward, all-gather backward (Korthikanti et al. 2022,
    ``g-bar`` in Figure 5; Megatron ``reduce_scatter_to_sequence_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter_dim(x, dim, group)  # (B, T, H) partial -> (B, T/tp, H) summed

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, ctx.dim, ctx.group), None, None  # (B, T/tp, H) -> (B, T, H)


class _ScatterToSPRegion(torch.autograd.Function):
    """Keep own chunk of the sequence forward, all-gather backward
    (Megatron ``scatter_to_sequence_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split_dim(x, dim, group)  # (B, T, H) -> (B, T/tp, H)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, ctx.dim, ctx.group), None, None  # (B, T/tp, H) -> (B, T, H)


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
        x_full = _all_gather_dim(x, dim, group)  # (B, T/tp, H) -> (B, T, H)
        weights = params[0::2]  # W_j: (out_j/tp, H)
        outs = tuple(F.linear(x_full, w, b) for w, b in zip(weights, params[1::2]))  # Y_j: (B, T, out_j/tp)
        ctx.save_for_backward(x if regather else x_full, *weights)
        return outs

    @staticmethod
    def backward(ctx, *grads):  # dY_j: (B, T, out_j/tp)
        saved, *weights = ctx.saved_tensors
        x_full = _all_gather_dim(saved, ctx.dim, ctx.group) if ctx.regather else saved  # (B, T, H)
        x2 = x_full.reshape(-1, x_full.shape[-1])  # (B*T, H)
        dx_full = None
        out = []
        for g, w, has_b in zip(grads, weights, ctx.has_bias):
            g2 = g.reshape(-1, g.shape[-1])  # (B*T, out_j/tp)
            contrib = g @ w  # (B, T, H), partial over the tp ranks
            dx_full = contrib if dx_full is None else dx_full + contrib
            out.append(g2.t() @ x2)  # dW_j: (out_j/tp, H)
            out.append(g2.sum(0) if has_b else None)  # db_j: (out_j/tp,)
        dx = _reduce_scatter_dim(dx_full, ctx.dim, ctx.group)  # (B, T, H) partial -> (B, T/tp, H) summed
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
        outs = _SPColumnRegion.apply(x, group, dim, regather, *flat)  # (B, T/tp, H) -> (B, T, out_j/tp) each
    else:
        if mode == "copy":
            x = copy_to_tp_region(x, group)  # (B, T, H)
        outs = [F.linear(x, w, b) for w, b in params]  # (B, T, out_j/tp) each
    return [_tag(o, "shard(-1)") for o in outs]
