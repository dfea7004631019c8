"""Prefill and decode with a KV cache on the lab's model (whole, or one rank's tensor-parallel shard).

One request's cache on one rank: ``[n_layers, 2, n_kv_heads/tp, capacity, head_dim]`` (K and V of every
layer, this rank's kv heads, ``capacity`` = prompt + max new tokens, reserved at admission). Every layer
keeps a key and a value vector per kv head for every token: ``2 · n_layers · n_kv_heads · head_dim · bytes``
per token (Pope et al. 2022, "Efficiently Scaling Transformer Inference", Sec. 2), as
:func:`labkit.theory.memory.kv_cache_bytes` predicts it.

One forward pass serves a *ragged batch* (:func:`forward_segments`): several segments, each a run of
tokens of one request at its own positions — a whole prompt (prefill), a chunk of one (chunked prefill:
Agrawal et al. 2024, "Sarathi-Serve", Sec. 4) or one new token (decode). The linear layers run once over
all the batch's tokens; attention runs per request over its own cache (decode tokens together, padded to
the longest cache, with a mask). :func:`prefill` and :func:`decode` are its two common cases.

The loops read only the layers' projections (``wq``/``wk``/``wv``/``wo``, the MLP, the norms), so the whole
model, a :func:`labkit.parallel.tensor.apply_tp` shard and a :mod:`~labkit.parallel.serving.quant` copy
run the same code: with TP, ``wo`` and the MLP's down projection are row-parallel (their all-reduce is
inside them) and the logits are this rank's vocabulary block, gathered by
:func:`~labkit.parallel.serving.tp.logits`.

Shapes: N tokens in the batch, S segments, T a segment's tokens, H hidden, hq / hk this rank's query / kv
heads, d head_dim, V vocabulary, C a cache's capacity.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from labkit.models import Transformer, apply_rope
from labkit.parallel.serving.tp import logits as full_logits


def qkv(attn, x: torch.Tensor, pos: torch.Tensor):
    """q [1, hq, N, d], k/v [1, hk, N, d] of ``attn`` for x [1, N, H] at positions ``pos`` [N]."""
    b, n, _ = x.shape
    d = attn.head_dim
    q = attn.wq(x).view(b, n, -1, d).transpose(1, 2)  # (1, N, hq*d) -> (1, hq, N, d)
    k = attn.wk(x).view(b, n, -1, d).transpose(1, 2)  # (1, N, hk*d) -> (1, hk, N, d)
    v = attn.wv(x).view(b, n, -1, d).transpose(1, 2)  # (1, hk, N, d)
    if attn.use_rope:
        cos, sin = attn.rope_cos[pos], attn.rope_sin[pos]  # (N, d/2): each token at its own position
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # shapes unchanged
    return q, k, v


def repeat_kv(k: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Grouped-query attention: each kv head serves ``n_rep`` query heads. [..., hk, L, d] -> [..., hq, L, d]."""
    return k.repeat_interleave(n_rep, dim=-3) if n_rep > 1 else k


def kv_cache_shape(model: Transformer, capacity: int) -> tuple[int, ...]:
    """Shape of one request's cache on this rank: [n_layers, 2, local kv heads, capacity, head_dim]."""
    a = model.layers[0].attn
    return (len(model.layers), 2, a.wk.out_features // a.head_dim, capacity, a.head_dim)


def _attend_decode(q, kv, mask, n_rep: int) -> torch.Tensor:
    """One query per sequence against its own cache, padded: q [B, hq, 1, d], kv [B, 2, hk, Lmax, d] (zero
    past each length), mask [B, Lmax] (True where a key exists). Returns [B, hq, 1, d]."""
    return F.scaled_dot_product_attention(q, repeat_kv(kv[:, 0], n_rep), repeat_kv(kv[:, 1], n_rep),
                                          attn_mask=mask[:, None, None, :])  # (B, hq, 1, d)


def _attend_chunk(q, cache, layer: int, start: int, n_rep: int) -> torch.Tensor:
    """A run of T queries at positions start..start+T-1 against cache positions 0..start+T-1, causally
    (bottom-right aligned; T = 1: one decode token). q [1, hq, T, d] -> [1, hq, T, d]."""
    t = q.shape[2]
    k = repeat_kv(cache[layer, 0, :, : start + t], n_rep)[None]  # (1, hq, start+T, d)
    v = repeat_kv(cache[layer, 1, :, : start + t], n_rep)[None]
    if t == 1 or start == 0:  # one query sees every key; or a whole prompt: the usual causal mask
        return F.scaled_dot_product_attention(q, k, v, is_causal=t > 1)  # (1, hq, T, d)
    mask = torch.ones(t, start + t, dtype=torch.bool, device=q.device).tril(diagonal=start)  # (T, start+T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (1, hq, T, d)


@torch.inference_mode()
def forward_segments(model: Transformer, segments: list[tuple[torch.Tensor, int, torch.Tensor]]) -> torch.Tensor:
    """One forward pass over a ragged batch. ``segments``: ``(tokens, start, cache)`` per request — int64
    tokens [T] at positions start..start+T-1, its cache with positions 0..start-1 already filled (written
    here: start..start+T-1). Returns the logits of every segment's last token, [S, vocab_size]."""
    dev = segments[0][0].device
    lens = [int(t.shape[0]) for t, _, _ in segments]
    starts = [int(s) for _, s, _ in segments]
    offs = [sum(lens[:j]) for j in range(len(lens))]
    toks = torch.cat([t for t, _, _ in segments])  # (N,)
    pos = torch.tensor([s + k for s, n in zip(starts, lens) for k in range(n)], device=dev)  # (N,)
    dec = [j for j, n in enumerate(lens) if n == 1]  # decode tokens attend together (when there are several)
    dec = dec if len(dec) > 1 else []
    chunks = [j for j, n in enumerate(lens) if n > 1 or not dec]
    if dec:
        idx = torch.tensor([offs[j] for j in dec], device=dev)  # (B,) where the decode tokens sit
        dlen = [starts[j] + 1 for j in dec]
        mask = torch.arange(max(dlen), device=dev)[None, :] < torch.tensor(dlen, device=dev)[:, None]  # (B, Lmax)
        c0 = segments[0][2]
        kvd = c0.new_zeros(len(dec), 2, c0.shape[2], max(dlen), c0.shape[4])  # (B, 2, hk, Lmax, d)
    x = model.embed_tokens(toks[None], pos)  # (1, N) -> (1, N, H); TP: all-reduce in the vocab-parallel embedding
    for i, layer in enumerate(model.layers):
        a = layer.attn
        h = layer.attn_norm(x)  # (1, N, H)
        q, k, v = qkv(a, h, pos)  # q (1, hq, N, d), k/v (1, hk, N, d)
        n_rep = q.shape[1] // k.shape[1]
        kv = torch.stack((k[0], v[0]))  # (2, hk, N, d)
        for (_, _, c), s, off, n in zip(segments, starts, offs, lens):
            c[i, :, :, s : s + n] = kv[:, :, off : off + n]  # (2, hk, T, d) at positions start..start+T-1
        o = torch.empty_like(q)  # (1, hq, N, d)
        if dec:
            for b, (j, n) in enumerate(zip(dec, dlen)):
                kvd[b, :, :, :n] = segments[j][2][i, :, :, :n]  # (2, hk, n, d): this sequence's whole cache
            qd = q[0].index_select(1, idx).transpose(0, 1)[:, :, None]  # (B, hq, 1, d)
            o[0].index_copy_(1, idx, _attend_decode(qd, kvd, mask, n_rep)[:, :, 0].transpose(0, 1))  # (hq, B, d)
        for j in chunks:
            off, n = offs[j], lens[j]
            o[:, :, off : off + n] = _attend_chunk(q[:, :, off : off + n], segments[j][2], i, starts[j], n_rep)
        x = x + a.wo(o.transpose(1, 2).reshape(1, len(pos), -1))  # (1, N, hq*d) -> (1, N, H); TP: all-reduce
        x = x + layer.mlp(layer.mlp_norm(x))  # (1, N, H); TP: all-reduce inside the MLP
    last = [off + n - 1 for off, n in zip(offs, lens)]
    return full_logits(model, x[:, last])[0]  # (1, S, H) -> (S, V)


def prefill(model: Transformer, tokens: torch.Tensor, cache: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Run prompt ``tokens`` (int64 [T], at positions start..start+T-1; start > 0: the next chunk of a
    chunked prefill) through ``model``, writing their keys and values into ``cache``
    ([n_layers, 2, kv heads, capacity >= start+T, d]). Returns the logits of the last position, [vocab_size]."""
    return forward_segments(model, [(tokens, int(start), cache)])[0]


def decode(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, caches: list[torch.Tensor]):
    """One decode step for B sequences: ``tokens`` int64 [B] (each sequence's latest token), ``positions``
    int64 [B] (where that token sits), ``caches`` their B caches (positions 0..p-1 filled; position p is
    written here). Returns logits [B, vocab_size]. The linear layers run batched; attention runs over each
    sequence's own cache length (padded to the longest, masked)."""
    return forward_segments(model, [(tokens[j : j + 1], int(positions[j]), caches[j])
                                    for j in range(tokens.shape[0])])
