"""The transformer blocks, tensor-parallel: attention with its heads split (GQA kv heads split or
replicated) and the MLP as column then row (Shoeybi et al. 2019, "Megatron-LM", Section 3, Figure 3).

Shapes: B batch, T sequence, H hidden, tp the group size, d head_dim, hq = n_heads/tp query heads and hk kv
heads per rank, F ffn_hidden_size. With sequence parallelism (Korthikanti et al. 2022) the block input and
output are the sequence shard (B, T/tp, H); inside the block every rank sees the whole sequence.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.checks import check_divides
from labkit.models import Attention, GeluMLP, SwiGLU, apply_rope
from labkit.parallel.tensor.layers import RowParallelLinear, ShardInfo, _even_info, _mark
from labkit.parallel.tensor.primitives import column_region, tp_rank, tp_size
from labkit.theory.tensor import kv_plan


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
    tp/n_kv_heads ranks and its gradient summed over them by
    :func:`~labkit.parallel.tensor.model.finalize_grads`); ``wo`` is row-parallel. Same parameter names as
    :class:`labkit.models.Attention`. x [B, T, H] (or [B, T/tp, H] with sequence parallelism) -> the same
    shape.
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
        # x: (B, T, H) replicated, or (B, T/tp, H) with SP (the region gathers it: f, or all-gather)
        q, k, v = column_region(x, [(m.weight, m.bias) for m in (self.wq, self.wk, self.wv)], mode=self.mode,
                                group=self.group, regather=self.regather)  # q (B, T, hq*d), k/v (B, T, hk*d)
        b, t, _ = q.shape
        d = self.head_dim
        # from here on, the same arithmetic as labkit.models.Attention.forward on this rank's heads
        q, k, v = (z.view(b, t, -1, d).transpose(1, 2) for z in (q, k, v))  # q (B, hq, T, d), k/v (B, hk, T, d)
        if self.use_rope:
            pos = torch.arange(t, device=x.device) if positions is None else positions  # (T,)
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # (T, d/2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # shapes unchanged
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:
            k = k.repeat_interleave(n_rep, dim=1)  # (B, hq, T, d)
            v = v.repeat_interleave(n_rep, dim=1)  # (B, hq, T, d)
        out = self.core(q, k, v, causal=True, dropout_p=self.dropout_p, training=self.training)  # (B, hq, T, d)
        # wo is row-parallel: (B, T, hq*d) -> (B, T, H) after g, or (B, T/tp, H) after g-bar with SP
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, H), or (B, T/tp, H) with SP
        if self.kind == "swiglu":
            gate, up = column_region(x, [(self.w_gate.weight, self.w_gate.bias), (self.w_up.weight, self.w_up.bias)],
                                     mode=self.mode, group=self.group, regather=self.regather)  # (B, T, F/tp) each
            return self.w_down(F.silu(gate) * up)  # (B, T, F/tp) -> (B, T, H), or (B, T/tp, H) with SP
        (h,) = column_region(x, [(self.fc_in.weight, self.fc_in.bias)], mode=self.mode, group=self.group,
                             regather=self.regather)  # (B, T, F/tp)
        return self.fc_out(F.gelu(h, approximate="tanh"))  # (B, T, F/tp) -> (B, T, H), or (B, T/tp, H) with SP

