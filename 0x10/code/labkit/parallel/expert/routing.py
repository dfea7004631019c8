"""The top-k router with a capacity per expert (Shazeer et al. 2017; GShard, Lepikhin et al. 2020 §2.2; Switch
Transformer, Fedus et al. 2022 §2.1).

Softmax over expert logits, the top_k experts per token, gates = their probabilities (optionally renormalised
to sum to 1, as Mixtral does), and a capacity per expert with a drop policy. Capacity = ceil(capacity_factor ·
tokens · top_k / n_experts) (:func:`labkit.theory.expert.expert_capacity`); assignments beyond it are dropped.

Shapes: N tokens, E experts, k = top_k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labkit.theory.expert import check_expert_parallel, expert_capacity


@dataclass
class Routing:
    """The router's decisions for N tokens.

    ``probs`` [N, E] softmax of the router logits; ``expert`` int64 [N, k] chosen experts (best first);
    ``gate`` [N, k] their weights (differentiable); ``keep`` bool [N, k] False where capacity dropped the
    assignment; ``capacity`` slots per expert (None = unlimited).
    """

    probs: torch.Tensor
    expert: torch.Tensor
    gate: torch.Tensor
    keep: torch.Tensor
    capacity: int | None

    @property
    def n_experts(self) -> int:
        """E, the number of experts (the last dimension of ``probs``)."""
        return self.probs.shape[-1]

    def tokens_per_expert(self) -> torch.Tensor:
        """int64 [E]: assignments routed to each expert before capacity."""
        return torch.bincount(self.expert.reshape(-1), minlength=self.n_experts)

    def kept_per_expert(self) -> torch.Tensor:
        """int64 [E]: assignments each expert processes (after capacity)."""
        return torch.bincount(self.expert[self.keep], minlength=self.n_experts)

    def stats(self) -> dict:
        """Plain numbers: ``tokens`` N, ``assignments`` N·k, ``tokens_per_expert``, ``kept_per_expert``,
        ``overflow_per_expert`` (routed − capacity, ≥ 0), ``dropped`` (assignments), ``dropped_tokens`` (tokens
        with every assignment dropped), ``capacity``, ``entropy`` (mean router entropy per token, nats;
        ln E = uniform) and ``aux_loss`` (:func:`load_balancing_loss`)."""
        routed, kept = self.tokens_per_expert(), self.kept_per_expert()  # (E,), (E,)
        n = self.probs.shape[0]
        probs = self.probs.detach()  # (N, E)
        ent = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)  # (N,)
        return {"tokens": n, "assignments": int(self.expert.numel()),
                "tokens_per_expert": routed.tolist(), "kept_per_expert": kept.tolist(),
                "overflow_per_expert": (routed - kept).tolist(), "dropped": int((routed - kept).sum()),
                "dropped_tokens": int((~self.keep.any(-1)).sum()) if n else 0, "capacity": self.capacity,
                "entropy": float(ent.mean()) if n else 0.0,
                "aux_loss": float(load_balancing_loss(self).detach()) if n else 0.0}


def route(logits: torch.Tensor, top_k: int, capacity_factor: float | None = None, *,
          drop_policy: str = "position", normalize: bool = False) -> Routing:
    """Top-k routing with a capacity per expert.

    ``logits`` [N, E] -> :class:`Routing`. Gates are the softmax probabilities of the chosen experts
    (``normalize=True``: divided by their sum). Capacity:
    :func:`~labkit.theory.expert.expert_capacity` of N tokens. Drop policy ``"position"``: every token's
    first choice before any second choice, earlier tokens first (GShard §2.2); ``"score"``: highest router
    probability first (Riquelme et al. 2021, "batch prioritized routing").
    Raises ValueError for top_k outside 1..E, capacity_factor <= 0, unknown drop_policy.
    """
    n, e = logits.shape  # (N, E)
    check_expert_parallel(e, top_k=top_k, capacity_factor=capacity_factor, drop_policy=drop_policy)
    probs = torch.softmax(logits.float(), dim=-1).to(logits.dtype)  # (N, E)
    gate, expert = torch.topk(probs, top_k, dim=-1)  # (N, k), (N, k)
    if normalize:
        gate = gate / gate.sum(-1, keepdim=True)  # (N, k)
    cap = expert_capacity(n, e, top_k, capacity_factor)
    if cap is None or n == 0:
        keep = torch.ones_like(expert, dtype=torch.bool)  # (N, k)
    else:
        flat_expert = expert.t().reshape(-1)  # (k·N,) slot-major: every token's 1st choice, then every 2nd choice
        if drop_policy == "position":
            order = torch.arange(flat_expert.numel(), device=logits.device)  # (k·N,)
        else:
            order = torch.argsort(gate.detach().t().reshape(-1), descending=True, stable=True)  # (k·N,)
        onehot = F.one_hot(flat_expert[order], e)  # (k·N, E), in serving order
        slot = ((onehot.cumsum(0) - 1) * onehot).sum(-1)  # (k·N,) position of each assignment in its expert's queue
        keep_flat = torch.empty_like(flat_expert, dtype=torch.bool)  # (k·N,)
        keep_flat[order] = slot < cap
        keep = keep_flat.view(top_k, n).t()  # (N, k)
    return Routing(probs, expert, gate, keep, cap)


def load_balancing_loss(routing: Routing) -> torch.Tensor:
    """Switch Transformer auxiliary loss (Fedus et al. 2022, eq. 4–6): ``E · Σ_e f_e · P_e`` with f_e the
    fraction of assignments routed to expert e and P_e the mean router probability of e. 1.0 when routing is
    uniform; differentiable through P. Multiply by a small coefficient (Switch: 1e-2) and add to the loss."""
    f = routing.tokens_per_expert().to(routing.probs.dtype) / max(1, routing.expert.numel())  # (E,)
    p = routing.probs.mean(0)  # (E,)
    return routing.n_experts * (f * p).sum()  # scalar
