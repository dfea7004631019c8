"""Stage modules: the lab's transformer cut into consecutive stages, and the split backward of ZB-H1.

* :class:`StageModule` — global stage ``s`` of ``n_stages``: a slice of a :class:`labkit.models.Transformer`'s
  blocks (sharing its modules, kept under their full-model names ``layers.<i>``), plus the embedding on the
  first stage and the final norm and output head on the last. Both the hand-written runner
  (:mod:`labkit.parallel.pipeline.runner`), torch's pipelining (:mod:`labkit.parallel.pipeline.torch_native`)
  and PP x DP (:mod:`labkit.parallel.composed`) run it.
* :class:`WeightGradStore`, :func:`defer_weight_grads` — ZB-H1's split backward (Qi et al. 2023, Sec. 2):
  B computes the input gradient dL/dx = g W at once and queues each ``nn.Linear``'s weight-gradient matmul
  dL/dW = g^T x, which W runs later.
* :func:`sync_tied_grads` — with tied embeddings the first and last stage each hold a copy of the embedding
  matrix; their gradients are summed after the flush (Megatron-LM's embedding-group all-reduce).
"""

from __future__ import annotations

import types
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.checks import check_divides
from labkit.models import Transformer
from labkit.parallel.pipeline.p2p import P2P, tied_grad_tag


class StageModule(nn.Module):
    """Global stage ``stage`` of ``n_stages`` of a :class:`labkit.models.Transformer`, sharing its modules.

    Holds the blocks ``layer_range = (first, end)`` (default: an equal share, ``n_layers / n_stages`` each;
    ValueError when that does not divide), under their full-model names ``layers.<i>`` so that
    ``named_parameters()`` names match the full model's. Stage 0 embeds tokens [b, T] (int64); every stage runs
    its blocks on hidden [b, T, H]; the last stage applies the final norm and the output projection and
    returns logits [b, T, V]. Reuses :meth:`Transformer.embed_tokens`, so the arithmetic is the reference's.
    With tied embeddings the last stage holds its own copy of the embedding matrix (``head_weight``) whose
    gradient :func:`sync_tied_grads` sums with stage 0's after the flush, so both copies stay equal.
    """

    def __init__(self, model: Transformer, stage: int, n_stages: int, layer_range: tuple[int, int] | None = None):
        super().__init__()
        spec = model.spec
        if layer_range is None:
            check_divides("n_stages", n_stages, "n_layers", spec.n_layers)
            per = spec.n_layers // n_stages
            layer_range = (stage * per, (stage + 1) * per)
        self.spec = spec
        self.stage, self.n_stages = stage, n_stages
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        self.embed = model.embed if self.is_first else None
        self.pos_embed = model.pos_embed if self.is_first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(*layer_range)})
        self.norm = model.norm if self.is_last else None
        self.lm_head = model.lm_head if self.is_last else None
        self.head_weight = None
        if self.is_last and model.lm_head is None:
            if self.is_first:
                raise ValueError("a single-stage pipeline cannot hold tied embeddings twice; use pp >= 2")
            self.head_weight = nn.Parameter(model.embed.weight.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = Transformer.embed_tokens(self, x)  # tokens [b, T] -> hidden [b, T, H]
        for layer in self.layers.values():
            x = layer(x)  # [b, T, H] -> [b, T, H]
        if self.is_last:
            x = self.norm(x)  # [b, T, H]
            x = self.lm_head(x) if self.lm_head is not None else x @ self.head_weight.t()  # logits [b, T, V]
        return x


def build_stages(spec, stages: Sequence[int], layers_per_stage: Sequence[int], *, seed: int = 0,
                 device: torch.device | str = "cpu") -> tuple[nn.Module, dict[int, StageModule]]:
    """Build the full model from ``(spec, seed)`` (identical weights on every rank and in the reference)
    and cut out the global ``stages`` this rank holds. Returns ``(model, {stage: StageModule})``; modules
    of other stages stay in ``model`` but receive no gradient."""
    from labkit.models import build_model

    model = build_model(spec, seed=seed, device=device)
    bounds = [0]
    for c in layers_per_stage:
        bounds.append(bounds[-1] + c)
    n = len(layers_per_stage)
    return model, {s: StageModule(model, s, n, (bounds[s], bounds[s + 1])).to(device) for s in stages}


def named_grads(model: nn.Module, stages: dict) -> dict[str, torch.Tensor]:
    """Gradients of this rank's parameters under their names in the full model (``layers.3.attn.wq.weight``).
    A tied embedding's head copy is left out: after :func:`sync_tied_grads` it equals ``embed.weight``'s."""
    mine = {id(p) for s in stages.values() for p in s.parameters()}
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if id(p) in mine and p.grad is not None}


def sync_tied_grads(ctx, schedule, stages: dict, p2p: P2P, tags: dict, tied: bool) -> None:
    """Sum the gradients of the two copies of a tied embedding (stage 0's ``embed.weight`` and the last
    stage's ``head_weight``) between their two ranks, so both copies take the same update. A no-op on the
    other ranks and for untied models. Recorded as one ``tied_grad`` event (kind comm) on ``ctx.timeline``."""
    first, last = schedule.rank_of(0), schedule.rank_of(schedule.n_stages - 1)
    if not tied or ctx.rank not in (first, last):
        return
    w = stages[0].embed.weight if ctx.rank == first else stages[schedule.n_stages - 1].head_weight
    g = (w.grad if w.grad is not None else torch.zeros_like(w)).contiguous()  # [V, H]
    other = last if ctx.rank == first else first
    buf = torch.empty_like(g)  # [V, H]: the other copy's gradient
    t0 = ctx.now_ns()
    tag = tied_grad_tag(schedule.n_stages, schedule.m)
    work = p2p.irecv(buf, other, tag)
    p2p.isend(g, other, tag, **tags)
    p2p.wait(work, buf, **tags)
    p2p.drain()
    p2p.check()
    w.grad = g + buf
    ctx.timeline.add("tied_grad", "comm", t0, ctx.now_ns(), nbytes=g.numel() * g.element_size(), **tags)


# ------------------------------------------------------------------------------------------------------
# split backward (ZB-H1): input gradients in B, weight gradients in W
# ------------------------------------------------------------------------------------------------------
class WeightGradStore:
    """Queues of deferred weight-gradient matmuls, keyed by (stage, microbatch) — filled during B, run by W.
    Set ``key`` before each B; ``run(key)`` is that (stage, micro-batch)'s W."""

    def __init__(self):
        self.key: tuple[int, int] | None = None
        self.queues: dict[tuple[int, int], list] = {}

    def put(self, fn) -> None:
        self.queues.setdefault(self.key, []).append(fn)

    def run(self, key: tuple[int, int]) -> int:
        fns = self.queues.pop(key, [])
        for fn in fns:
            fn()
        return len(fns)


class _DeferredLinear(torch.autograd.Function):
    """y = x W^T + b whose backward returns dL/dx at once and queues dL/dW = g^T x, dL/db = sum g."""

    @staticmethod
    def forward(ctx, x, weight, bias, store):
        ctx.save_for_backward(x)  # x [b, T, in]
        # the parameters themselves, not saved copies: W assigns their .grad (saved_tensors_hooks may hand
        # back another tensor object for a saved parameter)
        ctx.weight, ctx.bias, ctx.store = weight, bias, store
        return F.linear(x, weight, bias)  # [b, T, out]; weight [out, in]

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        weight, bias = ctx.weight, ctx.bias
        gx = g @ weight if ctx.needs_input_grad[0] else None  # B: [b, T, out] @ [out, in] -> [b, T, in]

        def weight_grad(g=g, x=x, weight=weight, bias=bias):  # W
            g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])  # [b*T, out], [b*T, in]
            gw = g2.t() @ x2  # [out, in]
            weight.grad = gw if weight.grad is None else weight.grad + gw
            if bias is not None:
                gb = g2.sum(0)  # [out]
                bias.grad = gb if bias.grad is None else bias.grad + gb

        ctx.store.put(weight_grad)
        return gx, None, None, None


def defer_weight_grads(module: nn.Module, store: WeightGradStore) -> int:
    """Make every nn.Linear inside ``module`` queue its weight gradient into ``store`` instead of computing
    it during backward. Returns the number of linears changed."""
    n = 0
    for lin in module.modules():
        if isinstance(lin, nn.Linear):
            def fwd(self, x, _store=store):
                return _DeferredLinear.apply(x, self.weight, self.bias, _store)

            lin.forward = types.MethodType(fwd, lin)
            n += 1
    return n
