"""Prefill and decode with a KV cache on the lab's model (whole, or one rank's tensor-parallel shard).

One request's cache on one rank: ``[n_layers, 2, n_kv_heads/tp, capacity, head_dim]`` (K and V of every
layer, this rank's kv heads, ``capacity`` = prompt + output tokens reserved at admission). Every layer keeps
a key and a value vector per kv head for every token: ``2 · n_layers · n_kv_heads · head_dim · bytes`` per
token (Pope et al. 2022, "Efficiently Scaling Transformer Inference", Sec. 2), as
:func:`labkit.theory.memory.kv_cache_bytes` predicts it.

The loops below read only the layers' projections (``wq``/``wk``/``wv``/``wo``, the MLP, the norms), so the
whole model and a :func:`labkit.parallel.tensor.apply_tp` shard run the same code: with TP, ``wo`` and the
MLP's down projection are row-parallel (their all-reduce is inside them) and the logits are this rank's
vocabulary block, gathered by :func:`~labkit.parallel.serving.tp.logits`.

Shapes: B sequences, T prompt tokens, H hidden, hq / hk this rank's query / kv heads, d head_dim, V vocab.
"""

from __future__ import annotations

import torch

from labkit.models import Transformer, apply_rope
from labkit.parallel.serving.tp import logits as full_logits


def qkv(attn, x: torch.Tensor, pos: torch.Tensor):
    """q [B, hq, T, d], k/v [B, hk, T, d] of ``attn`` for x [B, T, H] at positions ``pos`` ([T], or [B, 1]
    for one token per sequence at different positions)."""
    b, t, _ = x.shape
    d = attn.head_dim
    q = attn.wq(x).view(b, t, -1, d).transpose(1, 2)  # (B, T, hq*d) -> (B, hq, T, d)
    k = attn.wk(x).view(b, t, -1, d).transpose(1, 2)  # (B, T, hk*d) -> (B, hk, T, d)
    v = attn.wv(x).view(b, t, -1, d).transpose(1, 2)  # (B, hk, T, d)
    if attn.use_rope:
        cos, sin = attn.rope_cos[pos], attn.rope_sin[pos]  # (T, d/2), or (B, 1, d/2)
        if pos.dim() == 2:  # [B, 1, d/2] -> [B, 1, 1, d/2]: broadcast over heads
            cos, sin = cos[:, None], sin[:, None]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # shapes unchanged
    return q, k, v


def repeat_kv(k: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Grouped-query attention: each kv head serves ``n_rep`` query heads. [..., hk, T, d] -> [..., hq, T, d]."""
    return k.repeat_interleave(n_rep, dim=-3) if n_rep > 1 else k


def kv_cache_shape(model: Transformer, capacity: int) -> tuple[int, ...]:
    """Shape of one request's cache on this rank: [n_layers, 2, local kv heads, capacity, head_dim]."""
    a = model.layers[0].attn
    return (len(model.layers), 2, a.wk.out_features // a.head_dim, capacity, a.head_dim)


@torch.inference_mode()
def prefill(model: Transformer, tokens: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Run the whole prompt ``tokens`` (int64 [T]) through ``model``, writing keys and values of positions
    0..T-1 into ``cache`` ([n_layers, 2, kv heads, capacity >= T, d]). Returns the logits of the last
    position, [vocab_size]."""
    t = tokens.shape[0]
    pos = torch.arange(t, device=tokens.device)  # (T,)
    x = model.embed_tokens(tokens[None], pos)  # (1, T) -> (1, T, H)
    for i, layer in enumerate(model.layers):
        a = layer.attn
        h = layer.attn_norm(x)  # (1, T, H)
        q, k, v = qkv(a, h, pos)  # q (1, hq, T, d), k/v (1, hk, T, d)
        cache[i, 0, :, :t] = k[0]  # (hk, T, d) into positions 0..T-1
        cache[i, 1, :, :t] = v[0]
        n_rep = q.shape[1] // k.shape[1]
        o = a.core(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), causal=True)  # (1, hq, T, d)
        x = x + a.wo(o.transpose(1, 2).reshape(1, t, -1))  # (1, T, hq*d) -> (1, T, H); TP: all-reduce inside wo
        x = x + layer.mlp(layer.mlp_norm(x))  # (1, T, H); TP: all-reduce inside the MLP
    return full_logits(model, x[:, -1:])[0, 0]  # (1, 1, H) -> (V,)


@torch.inference_mode()
def decode(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor]):
    """One decode step for B sequences: ``tokens`` int64 [B] (each sequence's latest token), ``positions``
    int64 [B] (where that token sits), ``caches`` their B caches (positions 0..p-1 filled; position p is
    written here). Returns logits [B, vocab_size]. The linear layers run batched; attention runs per
    sequence over its own cache length (no padding)."""
    b = tokens.shape[0]
    x = model.embed(tokens[:, None])  # (B, 1) -> (B, 1, H); TP: all-reduce inside the vocab-parallel embedding
    if model.pos_embed is not None:
        x = x + model.pos_embed(positions)[:, None]  # + (B, 1, H)
    pos2 = positions[:, None]  # (B, 1)
    for i, layer in enumerate(model.layers):
        a = layer.attn
        h = layer.attn_norm(x)  # (B, 1, H)
        q, k, v = qkv(a, h, pos2)  # q (B, hq, 1, d), k/v (B, hk, 1, d)
        n_rep = q.shape[1] // k.shape[1]
        outs = []
        for j in range(b):
            p = int(positions[j])
            c = caches[j]
            c[i, 0, :, p] = k[j, :, 0]  # (hk, d) at position p
            c[i, 1, :, p] = v[j, :, 0]
            kk = repeat_kv(c[i, 0, :, : p + 1], n_rep)[None]  # (1, hq, p+1, d)
            vv = repeat_kv(c[i, 1, :, : p + 1], n_rep)[None]  # (1, hq, p+1, d)
            outs.append(a.core(q[j : j + 1], kk, vv, causal=False))  # (1, hq, 1, d): one query sees every key
        o = torch.cat(outs)  # (B, hq, 1, d)
        x = x + a.wo(o.transpose(1, 2).reshape(b, 1, -1))  # (B, 1, hq*d) -> (B, 1, H)
        x = x + layer.mlp(layer.mlp_norm(x))  # (B, 1, H)
    return full_logits(model, x)[:, 0]  # (B, 1, H) -> (B, V)
