"""The single-process mixture-of-experts layer: router + ``n_experts`` MLPs.

A dropped assignment contributes nothing, so a token dropped by every expert gets a zero MoE output: the layer
must sit on a residual path (``x + moe(norm(x))``, as in :class:`labkit.models.Block`) so the token passes
through unchanged instead of becoming a zero vector.

Shapes: N tokens, H hidden size, E experts, k = top_k, A kept assignments (at most N·k).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from labkit.checks import check_choice
from labkit.mlp import GeluMLP, SwiGLU
from labkit.parallel.expert.routing import Routing, load_balancing_loss, route
from labkit.theory.expert import check_expert_parallel


def _make_expert(hidden_size: int, ffn_hidden_size: int, mlp: str, bias: bool) -> nn.Module:
    if mlp == "swiglu":
        return SwiGLU(hidden_size, ffn_hidden_size, bias)
    return GeluMLP(hidden_size, ffn_hidden_size, bias)


def _kept_assignments(routing: Routing):
    """(token, expert, gate) of kept assignments, sorted by expert (stable)."""
    tok, slot = routing.keep.nonzero(as_tuple=True)  # (A,), (A,)
    exp = routing.expert[tok, slot]  # (A,)
    order = torch.argsort(exp, stable=True)  # (A,)
    return tok[order], exp[order], routing.gate[tok[order], slot[order]]  # (A,) each, grouped by expert


def _run_experts(experts, rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """rows grouped by expert (sizes[i] rows for experts[i]) -> each expert's output, same order.

    Every expert is called, also on zero rows, so the output is always connected to the experts' weights:
    under EP every rank then runs the combine all-to-all's backward (a rank skipping it would hang the rest)."""
    return torch.cat([expert(chunk) for expert, chunk in zip(experts, rows.split(sizes))])  # (rows, H)


class MoE(nn.Module):
    """A mixture-of-experts MLP: [..., H] -> [..., H] (the MoE contribution only; add the residual outside).

    Attributes: ``router`` (nn.Linear H -> n_experts, no bias), ``experts`` (nn.ModuleList of SwiGLU/GELU MLPs
    with ``ffn_hidden_size`` each), ``top_k``, ``capacity_factor`` (None = no limit; may be changed between
    calls), ``drop_policy``, ``normalize``; after each call ``last_routing`` (:class:`Routing`) and
    ``aux_loss`` (:func:`load_balancing_loss`, differentiable).

    Raises ValueError for top_k outside 1..n_experts, capacity_factor <= 0 or an unknown mlp / drop policy.
    """

    def __init__(self, hidden_size: int, ffn_hidden_size: int, n_experts: int, top_k: int, *, mlp: str = "swiglu",
                 bias: bool = False, capacity_factor: float | None = None, drop_policy: str = "position",
                 normalize: bool = False):
        super().__init__()
        check_choice("mlp", mlp, ("swiglu", "gelu"))
        check_expert_parallel(n_experts, top_k=top_k, capacity_factor=capacity_factor, drop_policy=drop_policy)
        self.hidden_size, self.n_experts, self.top_k = hidden_size, n_experts, top_k
        self.capacity_factor, self.drop_policy, self.normalize = capacity_factor, drop_policy, normalize
        self.router = nn.Linear(hidden_size, n_experts, bias=False)
        self.experts = nn.ModuleList(_make_expert(hidden_size, ffn_hidden_size, mlp, bias) for _ in range(n_experts))
        self.last_routing: Routing | None = None
        self.aux_loss: torch.Tensor | None = None

    @classmethod
    def from_spec(cls, spec, **kwargs) -> MoE:
        """The MoE layer of a :class:`~labkit.theory.spec.ModelSpec` with ``n_experts > 0``."""
        return cls(spec.hidden_size, spec.expert_ffn_hidden_size, spec.n_experts, spec.top_k, mlp=spec.mlp,
                   bias=spec.bias, **kwargs)

    def route(self, x: torch.Tensor) -> Routing:
        """Routing of x [N, H] with this layer's router and settings."""
        return route(self.router(x), self.top_k, self.capacity_factor, drop_policy=self.drop_policy,
                     normalize=self.normalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, H)
        routing = self.route(flat)  # expert, gate, keep: (N, k)
        tok, exp, gate = _kept_assignments(routing)  # (A,) each, grouped by expert
        sizes = torch.bincount(exp, minlength=self.n_experts).tolist()  # rows per expert, E of them
        out = _run_experts(self.experts, flat[tok], sizes)  # (A, H)
        y = torch.zeros_like(flat).index_add(0, tok, out * gate[:, None].to(out.dtype))  # (N, H): gated sum per token
        self.last_routing, self.aux_loss = routing, load_balancing_loss(routing)
        return y.view_as(x)  # (..., H)
