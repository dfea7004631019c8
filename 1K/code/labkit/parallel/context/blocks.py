"""Blockwise attention: one (query chunk, key chunk) pair at a time, merged with log-sum-exp.

For one block keep the output ``o_b = softmax(s_b) v_b`` and the log-sum-exp of its scores
``l_b = log Σ exp(s_b)``; two blocks merge exactly: ``l = log(e^{l_1} + e^{l_2})``,
``o = e^{l_1 − l}·o_1 + e^{l_2 − l}·o_2`` (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022,
Algorithm 1). So a rank can see the keys one block at a time, in any order: that is what ring attention,
all-gather KV and Ulysses all run locally. Backward is FlashAttention-2's (Dao 2023, Algorithm 2).

Which pairs are computed, and which get the triangular mask, is :func:`labkit.theory.context.chunk_pairs`:
only the diagonal pair is masked (masking every block is the classic bug, ``mask_policy="every_block"``).

Shapes: ``c`` tokens per chunk; a rank's queries are ``len(q_ids)`` chunks, its keys ``len(k_ids)`` chunks.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time

import torch

from labkit.theory.context import chunk_pairs

_WORK_COUNTERS: list[dict] = []


@contextlib.contextmanager
def count_work():
    """Count the attention work this process does inside the block: yields a dict with

    * ``"score_entries"`` — grows by B·heads·rows·cols for every chunk pair the forward kernel computes: a
      deterministic count of the work (the same on every run);
    * ``"kernel_cpu_ns"`` — CPU time of the calling thread inside the forward and backward block kernels
      (``time.thread_time_ns``): the work as timed, without communication, waits or per-step bookkeeping, and
      unaffected by other processes taking the cores (time spent descheduled is not CPU time). Complete only
      when torch runs on one thread (:func:`labkit.experiments.context.cp_profile_rank` sees to it)."""
    counter = {"score_entries": 0, "kernel_cpu_ns": 0}
    _WORK_COUNTERS.append(counter)
    try:
        yield counter
    finally:
        _WORK_COUNTERS.remove(counter)


@contextlib.contextmanager
def _kernel_cpu():
    if not _WORK_COUNTERS:
        yield
        return
    c0 = time.thread_time_ns()
    try:
        yield
    finally:
        dt = time.thread_time_ns() - c0
        for counter in _WORK_COUNTERS:
            counter["kernel_cpu_ns"] += dt


@contextlib.contextmanager
def _span(timeline, name: str, kind: str, **tags):
    """``timeline.span(...)`` when a timeline (anything with ``span``, e.g. ``ctx.timeline``) is given."""
    if timeline is None:
        yield
    else:
        with timeline.span(name, kind, **tags):
            yield


@functools.lru_cache(maxsize=8)
def _upper_mask(tq: int, tk: int, device) -> torch.Tensor:
    """bool [tq, tk], True above the diagonal (the future keys of a diagonal block); cached, so masking a
    block costs one in-place fill and not a fresh mask each call."""
    return torch.ones(tq, tk, dtype=torch.bool, device=device).triu(1)


def _block_scores(q, k, masked: bool, scale: float):
    s = torch.matmul(q, k.transpose(-2, -1)).mul_(scale)  # (B, heads, c_q, c_k)
    if masked:
        s.masked_fill_(_upper_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))  # (B, heads, c_q, c_k)
    return s


def _new_out_lse(q):
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)  # (B, heads, T_q, head_dim)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)  # (B, heads, T_q)
    return out, lse


def _attend(q, k, v, q_ids, k_ids, causal, out, lse, mask_policy="diagonal"):
    """Add the contribution of key/value chunks ``k_ids`` to the running (out, lse) of queries ``q_ids``.
    q [B,h,len(q_ids)*c,d], k/v [B,h,len(k_ids)*c,d]; out, lse updated in place. Returns pairs computed."""
    cq = q.shape[-2] // len(q_ids)  # tokens per query chunk
    ck = k.shape[-2] // len(k_ids)  # tokens per key chunk
    scale = 1.0 / math.sqrt(q.shape[-1])
    pairs = chunk_pairs(q_ids, k_ids, causal, mask_policy)
    with _kernel_cpu():
        _attend_pairs(q, k, v, pairs, cq, ck, scale, out, lse)
    for counter in _WORK_COUNTERS:
        counter["score_entries"] += len(pairs) * q.shape[:-2].numel() * cq * ck
    return len(pairs)


def _attend_pairs(q, k, v, pairs, cq, ck, scale, out, lse):
    for i, j, masked in pairs:
        qs, ks = slice(i * cq, (i + 1) * cq), slice(j * ck, (j + 1) * ck)
        s = _block_scores(q[..., qs, :], k[..., ks, :], masked, scale)  # (B, heads, c_q, c_k)
        blk_lse = torch.logsumexp(s, dim=-1)  # (B, heads, c_q)
        # a row whose keys are all masked (only possible with the buggy policy) contributes nothing
        safe = torch.where(torch.isinf(blk_lse), torch.zeros_like(blk_lse), blk_lse)  # (B, heads, c_q)
        blk_out = torch.exp(s - safe[..., None]) @ v[..., ks, :]  # (B, heads, c_q, head_dim)
        o, l_old = out[..., qs, :], lse[..., qs]  # views: (B, heads, c_q, head_dim), (B, heads, c_q)
        l_new = torch.logaddexp(l_old, blk_lse)  # (B, heads, c_q)
        l_new_safe = torch.where(torch.isinf(l_new), torch.zeros_like(l_new), l_new)  # (B, heads, c_q)
        w_old = torch.exp(l_old - l_new_safe)  # (B, heads, c_q): weight of what was merged so far
        w_blk = torch.exp(blk_lse - l_new_safe)  # (B, heads, c_q): weight of this block
        o.mul_(w_old[..., None]).add_(blk_out * w_blk[..., None])  # (B, heads, c_q, head_dim), in place
        l_old.copy_(l_new)  # (B, heads, c_q), in place


def _attend_backward(q, k, v, dout, lse, delta, q_ids, k_ids, causal, dq, dk, dv):
    """FlashAttention-2 backward (Dao 2023, Algorithm 2) for the chunk pairs of (q_ids, k_ids); adds into
    dq, dk, dv in place. ``lse`` is the final log-sum-exp per query row, ``delta`` = rowsum(dout * out)."""
    cq = q.shape[-2] // len(q_ids)
    ck = k.shape[-2] // len(k_ids)
    scale = 1.0 / math.sqrt(q.shape[-1])
    pairs = chunk_pairs(q_ids, k_ids, causal)
    with _kernel_cpu():
        for i, j, masked in pairs:
            qs, ks = slice(i * cq, (i + 1) * cq), slice(j * ck, (j + 1) * ck)
            qb, kb, vb, dob = q[..., qs, :], k[..., ks, :], v[..., ks, :], dout[..., qs, :]  # (B, heads, c, head_dim)
            p = torch.exp(_block_scores(qb, kb, masked, scale) - lse[..., qs, None])  # (B, heads, c_q, c_k)
            dv[..., ks, :] += p.transpose(-2, -1) @ dob  # (B, heads, c_k, head_dim)
            dp = dob @ vb.transpose(-2, -1)  # (B, heads, c_q, c_k)
            ds = p * (dp - delta[..., qs, None])  # (B, heads, c_q, c_k)
            dq[..., qs, :] += (ds @ kb) * scale  # (B, heads, c_q, head_dim)
            dk[..., ks, :] += (ds.transpose(-2, -1) @ qb) * scale  # (B, heads, c_k, head_dim)
    return len(pairs)


class _ChunkAttention(torch.autograd.Function):
    """Local blockwise attention between query chunks and key chunks (no communication). Saves q, k, v,
    out and the log-sum-exp for backward."""

    @staticmethod
    def forward(ctx, q, k, v, q_ids, k_ids, causal, timeline):
        # q (B, heads, T_q, head_dim); k, v (B, heads, T_k, head_dim)
        out, lse = _new_out_lse(q)  # (B, heads, T_q, head_dim), (B, heads, T_q)
        with _span(timeline, "attn fwd", "compute"):
            _attend(q, k, v, q_ids, k_ids, causal, out, lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (q_ids, k_ids, causal, timeline)
        return out  # (B, heads, T_q, head_dim)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        q_ids, k_ids, causal, timeline = ctx.meta
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)  # like q / k / v
        with _span(timeline, "attn bwd", "compute"):
            delta = (dout * out).sum(-1)  # (B, heads, T_q)
            _attend_backward(q, k, v, dout, lse, delta, q_ids, k_ids, causal, dq, dk, dv)
        return dq, dk, dv, None, None, None, None
