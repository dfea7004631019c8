"""Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers", §3; Brandon et al. 2023).

K/V blocks travel around the ring with ``isend``/``irecv`` while the current block is computed: at step s
rank r holds the K/V block of rank (r − s) mod cp, attends its queries to it and merges with log-sum-exp
(:mod:`labkit.parallel.context.blocks`). Backward (FlashAttention-2, Dao 2023, Algorithm 2) sends K/V around
again and passes the dK/dV accumulators along behind them, so no rank ever stores more than two K/V blocks.

:func:`ring_attention_emulated` runs the same ring in one process (the ranks and their steps are loops), and
can reproduce the classic bug of masking every block instead of only the diagonal.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from labkit.checks import check_choice
from labkit.parallel.context.blocks import _attend, _attend_backward, _new_out_lse, _span
from labkit.parallel.context.sharding import shard_sequence, unshard_sequence
from labkit.theory.context import MASK_POLICIES, check_context_parallel, chunk_ids

# gloo p2p tags (messages between the same pair of ranks are matched by tag)
_TAG_FWD_KV = 10
_TAG_BWD_KV = 20
_TAG_BWD_DKV = 1000


def _group_info(group):
    cp = dist.get_world_size(group)
    r = dist.get_rank(group)
    nxt = dist.get_global_rank(group, (r + 1) % cp) if group is not None else (r + 1) % cp
    prv = dist.get_global_rank(group, (r - 1) % cp) if group is not None else (r - 1) % cp
    return cp, r, nxt, prv


def _wait_all(works) -> None:
    """Wait on EVERY p2p handle. (With gloo, batched p2p returns one Work per op; waiting on only one of them
    deadlocks — pytorch/pytorch#152938. We issue plain isend/irecv and wait on each.)"""
    for w in works:
        if w is not None:
            w.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, load_balance, group, timeline):
        # q, k, v (B, heads, T/cp, head_dim): this rank's shard
        cp, r, nxt, prv = _group_info(group)
        my_ids = chunk_ids(r, cp, load_balance)
        out, lse = _new_out_lse(q)  # (B, heads, T/cp, head_dim), (B, heads, T/cp)
        kv = torch.stack([k, v])  # (2, B, heads, T/cp, head_dim): one message per step, K and V together
        nbytes = kv.numel() * kv.element_size()
        for step in range(cp):
            src = (r - step) % cp  # whose K/V block kv holds now
            works, nxt_kv, t0 = [], None, time.monotonic_ns()
            if step < cp - 1:  # prefetch the next block while computing this one
                nxt_kv = torch.empty_like(kv)  # (2, B, heads, T/cp, head_dim)
                works = [dist.isend(kv, nxt, group=group, tag=_TAG_FWD_KV),
                         dist.irecv(nxt_kv, prv, group=group, tag=_TAG_FWD_KV)]
            with _span(timeline, "attn fwd", "compute", stage=step):
                _attend(q, kv[0], kv[1], my_ids, chunk_ids(src, cp, load_balance), causal, out, lse)
            if works:
                _wait_all(works)
                if timeline is not None:
                    timeline.add("kv p2p", "comm", t0, time.monotonic_ns(), stage=step, nbytes=nbytes)
                kv = nxt_kv
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (causal, load_balance, group, timeline)
        return out  # (B, heads, T/cp, head_dim)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, load_balance, group, timeline = ctx.meta
        cp, r, nxt, prv = _group_info(group)
        my_ids = chunk_ids(r, cp, load_balance)
        dout = dout.contiguous()  # (B, heads, T/cp, head_dim)
        delta = (dout * out).sum(-1)  # (B, heads, T/cp)
        dq = torch.zeros_like(q)  # (B, heads, T/cp, head_dim)
        kv = torch.stack([k, v])  # (2, B, heads, T/cp, head_dim)
        nbytes = kv.numel() * kv.element_size()
        sends = []  # outstanding dK/dV sends (waited before the end)
        for step in range(cp):
            src = (r - step) % cp
            t0 = time.monotonic_ns()
            # post the receives in the order the neighbour sends (its accumulator at the end of its previous
            # step, then its next K/V block), so backends that match p2p by order (NCCL) agree with tag-matching
            # ones (gloo)
            acc_in, acc_work = None, []
            if step > 0:  # the dK/dV accumulated for block `src` by the ranks that held it before us
                acc_in = torch.empty_like(kv)  # (2, B, heads, T/cp, head_dim)
                acc_work = [dist.irecv(acc_in, prv, group=group, tag=_TAG_BWD_DKV + step)]
            kv_works, nxt_kv = [], None
            if step < cp - 1:
                nxt_kv = torch.empty_like(kv)  # (2, B, heads, T/cp, head_dim)
                kv_works = [dist.isend(kv, nxt, group=group, tag=_TAG_BWD_KV),
                            dist.irecv(nxt_kv, prv, group=group, tag=_TAG_BWD_KV)]
            dkv = torch.zeros_like(kv)  # (2, B, heads, T/cp, head_dim): dK, dV of block src
            with _span(timeline, "attn bwd", "compute", stage=step):
                _attend_backward(q, kv[0], kv[1], dout, lse, delta, my_ids, chunk_ids(src, cp, load_balance),
                                 causal, dq, dkv[0], dkv[1])
            _wait_all(acc_work)
            if acc_in is not None:
                dkv += acc_in  # (2, B, heads, T/cp, head_dim)
            # pass the accumulator on: after the last step it reaches the block's owner (rank src)
            sends.append(dist.isend(dkv, nxt, group=group, tag=_TAG_BWD_DKV + step + 1))
            _wait_all(kv_works)
            if timeline is not None:  # bytes this rank sends in this step: the next K/V block and the dK/dV
                timeline.add("kv+dkv p2p", "comm", t0, time.monotonic_ns(), stage=step,
                             nbytes=(nbytes if kv_works else 0) + nbytes)
            if nxt_kv is not None:
                kv = nxt_kv
        t0 = time.monotonic_ns()
        mine = torch.empty_like(kv)  # (2, B, heads, T/cp, head_dim): dK, dV of this rank's own block
        _wait_all([dist.irecv(mine, prv, group=group, tag=_TAG_BWD_DKV + cp)])
        _wait_all(sends)
        if timeline is not None:
            timeline.add("dkv p2p", "comm", t0, time.monotonic_ns(), stage=cp, nbytes=nbytes)
        return dq, mine[0], mine[1], None, None, None, None


def ring_attention_emulated(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: int, *, causal: bool = True,
                            load_balance: bool = False, mask_policy: str = "diagonal") -> torch.Tensor:
    """Ring attention forward on one process: the ``cp`` ranks and their ring steps are loops. Full
    q, k, v [B, heads, T, d] in, full output out (rows in natural order), no autograd.

    Each emulated rank r at step s attends its query chunks to the K/V chunks of rank (r−s) mod cp and
    merges with log-sum-exp, exactly as the distributed kernel. ``mask_policy="every_block"`` applies the
    causal mask to every block instead of only the diagonal (a real bug, kept for the lesson: the output is
    wrong). Raises ValueError for a bad configuration."""
    check_choice("mask_policy", mask_policy, MASK_POLICIES)
    check_context_parallel(q.shape[-2], cp, load_balance=load_balance)
    outs = []
    with torch.no_grad():
        for r in range(cp):
            qr = shard_sequence(q, cp, r, load_balance)  # (B, heads, T/cp, head_dim)
            out, lse = _new_out_lse(qr)  # (B, heads, T/cp, head_dim), (B, heads, T/cp)
            for step in range(cp):
                src = (r - step) % cp
                _attend(qr, shard_sequence(k, cp, src, load_balance), shard_sequence(v, cp, src, load_balance),
                        chunk_ids(r, cp, load_balance), chunk_ids(src, cp, load_balance), causal, out, lse,
                        mask_policy)
            outs.append(out)
    return unshard_sequence(outs, load_balance)  # (B, heads, T, head_dim)
