"""Context parallelism (CP): split the sequence over ``cp`` ranks and exchange keys/values for attention.

Every rank holds ``seq_len / cp`` tokens of each sequence. Everything in a transformer is per token except
attention, where each query needs every (earlier) key and value; this module supplies attention kernels that
take the local shards ``q, k, v`` [B, heads, seq_len/cp, head_dim] and return the local output, equal to
the matching rows of full-sequence attention, forward and backward:

* ``"ring"`` — ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers", §3; Brandon
  et al. 2023): K/V blocks travel around the ring with ``isend``/``irecv`` while the current block is
  computed; partial results are merged with the log-sum-exp trick (Milakov & Gimelshein 2018; FlashAttention,
  Dao et al. 2022, Algorithm 1). Backward (FlashAttention-2, Dao 2023, Algorithm 2) sends K/V around again
  and passes the dK/dV accumulators along behind them, so no rank ever stores more than two K/V blocks.
* ``"allgather"`` — all-gather K/V, attend locally, reduce-scatter dK/dV (Llama 3, Dubey et al. 2024,
  §3.3.2 "Context parallelism").
* ``"ulysses"`` — DeepSpeed-Ulysses (Jacobs et al. 2023, §3): one all-to-all turns sequence shards into
  head shards (each rank gets ``n_heads/cp`` heads of the whole sequence), attention runs locally, a second
  all-to-all turns the output back into sequence shards.

Sharding (``load_balance``): the sequence is cut into ``cp`` chunks (contiguous, rank r holds chunk r) or
``2·cp`` chunks (load-balanced "zigzag"/head-tail: rank r holds chunks r and 2·cp−1−r; Megatron-LM CP,
Llama 3 §3.3.2). With causal attention, contiguous sharding gives rank r ``r+1`` blocks of work and the last
rank ``cp`` times the first's; zigzag gives every rank the same ``(2·cp+1)/4`` blocks.

Causal masking is decided per *chunk pair* from the chunks' global positions: a key chunk before the query
chunk is fully visible (no mask), the same chunk gets the triangular mask, a later chunk is skipped. Only the
diagonal is masked — masking every block is the classic bug (:func:`ring_attention_emulated` can reproduce
it). Non-causal attention sees every pair unmasked, with or without load balancing.

Validation (:func:`check_context_parallel`): seq_len divisible by cp (by 2·cp with load balancing), n_heads
divisible by cp for Ulysses. Dropout inside attention is not supported (ValueError). Chapter 07 validates its
parameters with :func:`check_chapter` before it launches anything.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time

import torch
import torch.distributed as dist

from labkit.checks import check_choice, check_divides, positive_int
from labkit.runtime.commlog import all_gather_tensor, reduce_scatter_tensor

METHODS = ("ring", "allgather", "ulysses")
MASK_POLICIES = ("diagonal", "every_block")

# gloo p2p tags (messages between the same pair of ranks are matched by tag)
_TAG_FWD_KV = 10
_TAG_BWD_KV = 20
_TAG_BWD_DKV = 1000


# ------------------------------------------------------------------------------------------------------
# sharding (pure index arithmetic)
# ------------------------------------------------------------------------------------------------------
def check_context_parallel(seq_len: int, cp: int, *, load_balance: bool = False, method: str = "ring",
                           n_heads: int | None = None) -> None:
    """Validate a CP configuration before launching. Raises ValueError naming the value and the valid ones:
    ``cp`` must divide ``seq_len`` (``2·cp`` with ``load_balance``), ``method`` must be one of
    :data:`METHODS`, and for Ulysses ``cp`` must divide ``n_heads``."""
    check_choice("method", method, METHODS)
    cp = positive_int("cp", cp)
    seq_len = positive_int("seq_len", seq_len)
    if load_balance:
        if seq_len % (2 * cp):
            valid = [c for c in range(1, seq_len // 2 + 1) if seq_len % (2 * c) == 0]
            raise ValueError(f"2·cp={2 * cp} does not divide seq_len={seq_len}: load balancing cuts the sequence "
                             f"into 2·cp chunks; valid cp: {', '.join(map(str, valid))}")
    else:
        check_divides("cp", cp, "seq_len", seq_len)
    if method == "ulysses":
        if n_heads is None:
            raise ValueError("method='ulysses' needs n_heads (Ulysses shards attention heads over cp ranks)")
        check_divides("cp", cp, "n_heads", n_heads, hint="Ulysses gives each rank n_heads/cp heads")


def check_chapter(*, world_size: int, seq_len: int, n_heads: int, head_dim: int, batch: int, repeats: int,
                  backend: str = "auto") -> None:
    """Validate chapter 07's parameters before anything is launched (the chapter's first code cell).

    Raises ValueError naming the value and the fix: world_size < 2 (context parallelism splits the sequence
    over ranks: one rank has nothing to exchange), 2·world_size not dividing seq_len (zigzag cuts the
    sequence into 2·cp chunks), world_size not dividing n_heads (Ulysses), sizes or repeats < 1, or a backend
    the machine cannot run (:func:`labkit.runtime.launcher.resolve_backend`)."""
    from labkit.runtime.launcher import resolve_backend

    world_size = positive_int("world_size", world_size)
    if world_size < 2:
        raise ValueError(f"chapter 07 needs world_size >= 2: context parallelism splits the sequence over ranks "
                         f"and exchanges keys and values between them; got world_size={world_size}")
    for name, value in (("seq_len", seq_len), ("n_heads", n_heads), ("head_dim", head_dim), ("batch", batch),
                        ("repeats", repeats)):
        positive_int(name, value)
    problems = []
    if seq_len % (2 * world_size):
        problems.append(f"2·cp={2 * world_size} does not divide seq_len={seq_len} (zigzag cuts the sequence into "
                        "2·cp chunks)")
    if n_heads % world_size:
        problems.append(f"cp={world_size} does not divide n_heads={n_heads} (Ulysses gives each rank n_heads/cp "
                        "heads)")
    if problems:
        valid = chapter_cp_degrees(seq_len, n_heads)
        fix = (f"world_size (= cp) values that pass every rule of chapter 07 with seq_len={seq_len}, "
               f"n_heads={n_heads}: {', '.join(map(str, valid))}" if valid else
               f"no world_size passes every rule of chapter 07 with seq_len={seq_len}, n_heads={n_heads}: "
               "choose an even n_heads and a seq_len that 4 divides, e.g. n_heads=4, seq_len=1024")
        raise ValueError(f"chapter 07 runs cp = world_size={world_size}: {'; '.join(problems)}; {fix}; or choose "
                         "seq_len / n_heads that it divides")
    resolve_backend(backend, world_size)


def chapter_cp_degrees(seq_len: int, n_heads: int) -> list[int]:
    """The world_size (= cp) values chapter 07 accepts for ``seq_len`` and ``n_heads`` (the backend aside):
    cp >= 2, 2·cp dividing seq_len (zigzag) and cp dividing n_heads (Ulysses), so never above n_heads.
    Raises ValueError for a non-positive size."""
    seq_len, n_heads = positive_int("seq_len", seq_len), positive_int("n_heads", n_heads)
    return [c for c in range(2, n_heads + 1) if n_heads % c == 0 and seq_len % (2 * c) == 0]


def model_cases(world_size: int, spec: str = "lab-tiny-llama") -> tuple[list[dict], list[str]]:
    """The whole-model parity cases chapter 07 runs on ``world_size`` ranks (:func:`cp_parity_rank`'s
    ``model_cases``): ring with zigzag, and Ulysses when ``world_size`` divides the model's heads (and its
    kv heads are repeated to them). Returns ``(cases, skipped)``, ``skipped`` saying why a case was left out.
    A case also needs the model's ``max_seq_len`` to hold 8·world_size tokens."""
    from labkit.theory.spec import get_spec

    m = get_spec(spec)
    cases, skipped = [], []
    if 8 * world_size > m.max_seq_len:
        return [], [f"{spec}: max_seq_len={m.max_seq_len} cannot hold 8·world_size={8 * world_size} tokens"]
    cases.append({"method": "ring", "load_balance": True})
    if m.n_heads % world_size == 0:
        cases.append({"method": "ulysses", "load_balance": False})
    else:
        skipped.append(f"ulysses on {spec}: cp={world_size} does not divide its n_heads={m.n_heads}")
    return cases, skipped


def n_chunks(cp: int, load_balance: bool = False) -> int:
    """Number of equal sequence chunks: ``cp`` (contiguous) or ``2·cp`` (load-balanced)."""
    return 2 * cp if load_balance else cp


def chunk_ids(rank: int, cp: int, load_balance: bool = False) -> list[int]:
    """Global chunk indices held by ``rank``: ``[rank]`` or ``[rank, 2·cp−1−rank]`` (zigzag)."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank} must be in 0..{cp - 1}")
    return [rank, 2 * cp - 1 - rank] if load_balance else [rank]


def shard_positions(seq_len: int, cp: int, rank: int, load_balance: bool = False) -> torch.Tensor:
    """Absolute token positions (int64 [seq_len/cp]) held by ``rank``, in local order.

    Raises ValueError if cp (2·cp) does not divide seq_len."""
    check_context_parallel(seq_len, cp, load_balance=load_balance)
    c = seq_len // n_chunks(cp, load_balance)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(rank, cp, load_balance)])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, load_balance: bool = False, dim: int = -2) -> torch.Tensor:
    """The part of ``x`` (sequence along ``dim``, default -2 as in [B, heads, T, d]) held by ``rank``."""
    pos = shard_positions(x.shape[dim], cp, rank, load_balance).to(x.device)
    return x.index_select(dim, pos)


def unshard_sequence(shards: list[torch.Tensor], load_balance: bool = False, dim: int = -2) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence from the ``cp`` shards in rank order."""
    cp = len(shards)
    seq_len = shards[0].shape[dim] * cp
    pos = torch.cat([shard_positions(seq_len, cp, r, load_balance) for r in range(cp)]).to(shards[0].device)
    cat = torch.cat(shards, dim=dim)
    return cat.index_select(dim, torch.argsort(pos))


# ------------------------------------------------------------------------------------------------------
# the blockwise kernel: chunk pairs, log-sum-exp merge
# ------------------------------------------------------------------------------------------------------
def chunk_pairs(q_ids: list[int], k_ids: list[int], causal: bool,
                mask_policy: str = "diagonal") -> list[tuple[int, int, bool]]:
    """Which (query chunk, key chunk) pairs to compute, and whether the pair needs the triangular mask.

    Returns ``(i, j, masked)`` with i / j indices into ``q_ids`` / ``k_ids``. Causal, ``"diagonal"``
    policy (correct): key chunk before query chunk -> computed unmasked; same chunk -> computed with the
    triangular mask; later chunk -> skipped. Non-causal: every pair, unmasked. ``"every_block"`` reproduces
    the classic bug: every pair computed with the local triangular mask.
    """
    out = []
    for i, qi in enumerate(q_ids):
        for j, kj in enumerate(k_ids):
            if not causal:
                out.append((i, j, False))
            elif mask_policy == "every_block":
                out.append((i, j, True))
            elif kj < qi:
                out.append((i, j, False))
            elif kj == qi:
                out.append((i, j, True))
    return out


@functools.lru_cache(maxsize=8)
def _upper_mask(tq: int, tk: int, device) -> torch.Tensor:
    """bool [tq, tk], True above the diagonal (the future keys of a diagonal block); cached, so masking a
    block costs one in-place fill and not a fresh mask each call."""
    return torch.ones(tq, tk, dtype=torch.bool, device=device).triu(1)


def _block_scores(q, k, masked: bool, scale: float):
    s = torch.matmul(q, k.transpose(-2, -1)).mul_(scale)
    if masked:
        s.masked_fill_(_upper_mask(s.shape[-2], s.shape[-1], s.device), float("-inf"))
    return s


_WORK_COUNTERS: list[dict] = []


@contextlib.contextmanager
def count_work():
    """Count the attention work this process does inside the block: yields a dict with

    * ``"score_entries"`` — grows by B·heads·rows·cols for every chunk pair the forward kernel computes: a
      deterministic count of the work (the same on every run);
    * ``"kernel_cpu_ns"`` — CPU time of the calling thread inside the forward and backward block kernels
      (``time.thread_time_ns``): the work as timed, without communication, waits or per-step bookkeeping, and
      unaffected by other processes taking the cores (time spent descheduled is not CPU time). Complete only
      when torch runs on one thread (:func:`cp_profile_rank` sees to it)."""
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


def _attend(q, k, v, q_ids, k_ids, causal, out, lse, mask_policy="diagonal"):
    """Add the contribution of key/value chunks ``k_ids`` to the running (out, lse) of queries ``q_ids``.
    q [B,h,len(q_ids)*c,d], k/v [B,h,len(k_ids)*c,d]; out, lse updated in place. Returns pairs computed."""
    cq = q.shape[-2] // len(q_ids)
    ck = k.shape[-2] // len(k_ids)
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
        s = _block_scores(q[..., qs, :], k[..., ks, :], masked, scale)
        blk_lse = torch.logsumexp(s, dim=-1)
        # a row whose keys are all masked (only possible with the buggy policy) contributes nothing
        safe = torch.where(torch.isinf(blk_lse), torch.zeros_like(blk_lse), blk_lse)
        blk_out = torch.exp(s - safe[..., None]) @ v[..., ks, :]
        o, l_old = out[..., qs, :], lse[..., qs]
        l_new = torch.logaddexp(l_old, blk_lse)
        l_new_safe = torch.where(torch.isinf(l_new), torch.zeros_like(l_new), l_new)
        w_old = torch.exp(l_old - l_new_safe)
        w_blk = torch.exp(blk_lse - l_new_safe)
        o.mul_(w_old[..., None]).add_(blk_out * w_blk[..., None])
        l_old.copy_(l_new)


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
            qb, kb, vb, dob = q[..., qs, :], k[..., ks, :], v[..., ks, :], dout[..., qs, :]
            p = torch.exp(_block_scores(qb, kb, masked, scale) - lse[..., qs, None])
            dv[..., ks, :] += p.transpose(-2, -1) @ dob
            dp = dob @ vb.transpose(-2, -1)
            ds = p * (dp - delta[..., qs, None])
            dq[..., qs, :] += (ds @ kb) * scale
            dk[..., ks, :] += (ds.transpose(-2, -1) @ qb) * scale
    return len(pairs)


def _new_out_lse(q):
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    return out, lse


@contextlib.contextmanager
def _span(timeline, name: str, kind: str, **tags):
    if timeline is None:
        yield
    else:
        with timeline.span(name, kind, **tags):
            yield


class _ChunkAttention(torch.autograd.Function):
    """Local blockwise attention between query chunks and key chunks (no communication). Saves q, k, v,
    out and the log-sum-exp for backward."""

    @staticmethod
    def forward(ctx, q, k, v, q_ids, k_ids, causal, timeline):
        out, lse = _new_out_lse(q)
        with _span(timeline, "attn fwd", "compute"):
            _attend(q, k, v, q_ids, k_ids, causal, out, lse)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (q_ids, k_ids, causal, timeline)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        q_ids, k_ids, causal, timeline = ctx.meta
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        with _span(timeline, "attn bwd", "compute"):
            delta = (dout * out).sum(-1)
            _attend_backward(q, k, v, dout, lse, delta, q_ids, k_ids, causal, dq, dk, dv)
        return dq, dk, dv, None, None, None, None


# ------------------------------------------------------------------------------------------------------
# ring attention
# ------------------------------------------------------------------------------------------------------
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
        cp, r, nxt, prv = _group_info(group)
        my_ids = chunk_ids(r, cp, load_balance)
        out, lse = _new_out_lse(q)
        kv = torch.stack([k, v])  # one message per step: K and V together
        nbytes = kv.numel() * kv.element_size()
        for step in range(cp):
            src = (r - step) % cp
            works, nxt_kv, t0 = [], None, time.monotonic_ns()
            if step < cp - 1:  # prefetch the next block while computing this one
                nxt_kv = torch.empty_like(kv)
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
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, load_balance, group, timeline = ctx.meta
        cp, r, nxt, prv = _group_info(group)
        my_ids = chunk_ids(r, cp, load_balance)
        dout = dout.contiguous()
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
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
                acc_in = torch.empty_like(kv)
                acc_work = [dist.irecv(acc_in, prv, group=group, tag=_TAG_BWD_DKV + step)]
            kv_works, nxt_kv = [], None
            if step < cp - 1:
                nxt_kv = torch.empty_like(kv)
                kv_works = [dist.isend(kv, nxt, group=group, tag=_TAG_BWD_KV),
                            dist.irecv(nxt_kv, prv, group=group, tag=_TAG_BWD_KV)]
            dkv = torch.zeros_like(kv)
            with _span(timeline, "attn bwd", "compute", stage=step):
                _attend_backward(q, kv[0], kv[1], dout, lse, delta, my_ids, chunk_ids(src, cp, load_balance),
                                 causal, dq, dkv[0], dkv[1])
            _wait_all(acc_work)
            if acc_in is not None:
                dkv += acc_in
            # pass the accumulator on: after the last step it reaches the block's owner (rank src)
            sends.append(dist.isend(dkv, nxt, group=group, tag=_TAG_BWD_DKV + step + 1))
            _wait_all(kv_works)
            if timeline is not None:  # bytes this rank sends in this step: the next K/V block and the dK/dV
                timeline.add("kv+dkv p2p", "comm", t0, time.monotonic_ns(), stage=step,
                             nbytes=(nbytes if kv_works else 0) + nbytes)
            if nxt_kv is not None:
                kv = nxt_kv
        t0 = time.monotonic_ns()
        mine = torch.empty_like(kv)
        _wait_all([dist.irecv(mine, prv, group=group, tag=_TAG_BWD_DKV + cp)])
        _wait_all(sends)
        if timeline is not None:
            timeline.add("dkv p2p", "comm", t0, time.monotonic_ns(), stage=cp, nbytes=nbytes)
        return dq, mine[0], mine[1], None, None, None, None


# ------------------------------------------------------------------------------------------------------
# all-gather KV and Ulysses: differentiable collectives
# ------------------------------------------------------------------------------------------------------
class _AllGatherSeq(torch.autograd.Function):
    """[*, T/cp, d] -> [*, T, d] concatenated in group-rank order; backward reduce-scatters (sums) the
    gradient back to the shards."""

    @staticmethod
    def forward(ctx, x, group, timeline):
        cp = dist.get_world_size(group)
        x = x.contiguous()
        buf = torch.empty((cp, *x.shape), dtype=x.dtype, device=x.device)
        with _span(timeline, "all_gather kv", "comm", nbytes=buf.numel() * buf.element_size()):
            all_gather_tensor(buf.view(-1), x.view(-1), group=group)
        ctx.meta = (group, timeline, cp)
        return buf.movedim(0, -3).flatten(-3, -2)

    @staticmethod
    def backward(ctx, g):
        group, timeline, cp = ctx.meta
        parts = g.unflatten(-2, (cp, g.shape[-2] // cp)).movedim(-3, 0).contiguous()
        out = torch.empty(parts.shape[1:], dtype=g.dtype, device=g.device)
        with _span(timeline, "reduce_scatter dkv", "comm", nbytes=parts.numel() * parts.element_size()):
            reduce_scatter_tensor(out.view(-1), parts.view(-1), group=group)
        return out, None, None


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_head(x, group, timeline, name):
    """[*, h, T/cp, d] sequence-sharded -> [*, h/cp, T, d] head-sharded (sequence in group-rank order)."""
    cp = dist.get_world_size(group)
    send = x.unflatten(-3, (cp, x.shape[-3] // cp)).movedim(-4, 0).contiguous()  # [cp_dst, *, h/cp, T/cp, d]
    with _span(timeline, name, "comm", nbytes=send.numel() * send.element_size()):
        recv = _all_to_all(send, group)  # [cp_src, *, h/cp, T/cp, d]
    return recv.movedim(0, -3).flatten(-3, -2)


def _head_to_seq(y, group, timeline, name):
    """Inverse of :func:`_seq_to_head`: [*, h/cp, T, d] -> [*, h, T/cp, d]."""
    cp = dist.get_world_size(group)
    send = y.unflatten(-2, (cp, y.shape[-2] // cp)).movedim(-3, 0).contiguous()  # [cp_dst, *, h/cp, T/cp, d]
    with _span(timeline, name, "comm", nbytes=send.numel() * send.element_size()):
        recv = _all_to_all(send, group)  # [cp_src, *, h/cp, T/cp, d]
    return recv.movedim(0, -4).flatten(-4, -3)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, timeline):
        ctx.meta = (group, timeline)
        return _seq_to_head(x, group, timeline, "all_to_all qkv")

    @staticmethod
    def backward(ctx, g):
        group, timeline = ctx.meta
        return _head_to_seq(g, group, timeline, "all_to_all dqkv"), None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, timeline):
        ctx.meta = (group, timeline)
        return _head_to_seq(y, group, timeline, "all_to_all out")

    @staticmethod
    def backward(ctx, g):
        group, timeline = ctx.meta
        return _seq_to_head(g, group, timeline, "all_to_all dout"), None, None


# ------------------------------------------------------------------------------------------------------
# public entry points
# ------------------------------------------------------------------------------------------------------
def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, method: str = "ring",
                               causal: bool = True, load_balance: bool = False, group=None,
                               timeline=None) -> torch.Tensor:
    """Attention of this rank's sequence shard, equal to the matching rows of full-sequence attention.

    Args:
        q, k, v: [B, heads, seq_len/cp, head_dim], the shard given by :func:`shard_sequence` with the same
            ``load_balance`` (k/v with as many heads as q: repeat grouped-query K/V heads first).
        method: ``"ring"``, ``"allgather"`` or ``"ulysses"`` (module docstring).
        causal: causal (decoder) masking by global position; False attends to every token.
        load_balance: shards are zigzag (chunks r and 2·cp−1−r of 2·cp); must match how q/k/v were sharded.
        group: the CP process group (default: the whole world); every rank of it must call.
        timeline: a :class:`~labkit.runtime.timeline.Timeline` (``ctx.timeline``) to record compute/comm events
            (``stage`` = ring step for ring attention).

    Returns: [B, heads, seq_len/cp, head_dim]. Differentiable in q, k, v.
    Raises ValueError: bad method, mismatched shard shapes, an odd shard with load balancing, heads not
    divisible by cp for Ulysses.
    """
    check_choice("method", method, METHODS)
    cp = dist.get_world_size(group)
    r = dist.get_rank(group)
    per_rank = len(chunk_ids(r, cp, load_balance))
    if q.shape[-2] % per_rank or k.shape[-2] != q.shape[-2] or v.shape != k.shape or q.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected equal [B, heads, "
                         f"seq_len/cp, head_dim] shards (repeat grouped K/V heads first) with seq_len/cp divisible "
                         f"by {per_rank} (load_balance={load_balance})")
    if cp == 1:
        ids = chunk_ids(0, 1, load_balance)
        return _ChunkAttention.apply(q, k, v, ids, ids, causal, timeline)
    if method == "ring":
        return _RingAttention.apply(q, k, v, causal, load_balance, group, timeline)
    all_ids = [c for s in range(cp) for c in chunk_ids(s, cp, load_balance)]
    if method == "allgather":
        kv = _AllGatherSeq.apply(torch.stack([k, v]), group, timeline)
        return _ChunkAttention.apply(q, kv[0], kv[1], chunk_ids(r, cp, load_balance), all_ids, causal, timeline)
    check_divides("cp", cp, "n_heads", q.shape[-3], hint="Ulysses gives each rank n_heads/cp heads")
    qkv = _SeqToHead.apply(torch.stack([q, k, v]), group, timeline)
    out = _ChunkAttention.apply(qkv[0], qkv[1], qkv[2], all_ids, all_ids, causal, timeline)
    return _HeadToSeq.apply(out, group, timeline)


class ContextParallelAttention:
    """A drop-in ``Attention.core`` (see :class:`labkit.models.Attention`) running
    :func:`context_parallel_attention`. Raises ValueError when called with dropout in training mode
    (attention dropout is not implemented by these kernels)."""

    def __init__(self, method: str = "ring", *, load_balance: bool = False, group=None, timeline=None):
        check_choice("method", method, METHODS)
        self.method, self.load_balance, self.group, self.timeline = method, load_balance, group, timeline

    def __call__(self, q, k, v, *, causal: bool = True, dropout_p: float = 0.0, training: bool = False):
        if dropout_p and training:
            raise ValueError(f"dropout_p={dropout_p} in attention is not supported with context parallelism; "
                             "use a spec with dropout=0.0 or model.eval()")
        return context_parallel_attention(q, k, v, method=self.method, causal=causal,
                                          load_balance=self.load_balance, group=self.group,
                                          timeline=self.timeline)

    def __repr__(self) -> str:
        return f"ContextParallelAttention(method={self.method!r}, load_balance={self.load_balance})"


def apply_context_parallel(model, method: str = "ring", *, load_balance: bool = False, group=None,
                           timeline=None):
    """Swap every layer's attention kernel (``layer.attn.core``) of a :class:`labkit.models.Transformer`
    for :class:`ContextParallelAttention`. Then call ``model(tokens_shard, positions=positions_shard)``
    with the shards of :func:`shard_sequence` / :func:`shard_positions`; per-token layers need no change.
    Gradients of the (replicated) weights must be summed over the CP group afterwards. Returns ``model``."""
    core = ContextParallelAttention(method, load_balance=load_balance, group=group, timeline=timeline)
    for layer in model.layers:
        layer.attn.core = core
    return model


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
            qr = shard_sequence(q, cp, r, load_balance)
            out, lse = _new_out_lse(qr)
            for step in range(cp):
                src = (r - step) % cp
                _attend(qr, shard_sequence(k, cp, src, load_balance), shard_sequence(v, cp, src, load_balance),
                        chunk_ids(r, cp, load_balance), chunk_ids(src, cp, load_balance), causal, out, lse,
                        mask_policy)
            outs.append(out)
    return unshard_sequence(outs, load_balance)


# ------------------------------------------------------------------------------------------------------
# predictions (pure Python)
# ------------------------------------------------------------------------------------------------------
def predicted_pair_blocks(cp: int, *, load_balance: bool = False, causal: bool = True,
                          method: str = "ring") -> list[tuple[float, float]]:
    """Per rank, the attention work split into ``(full, diagonal)`` blocks of (seq_len/cp)² score entries ×
    all heads: chunk pairs computed without a mask, and diagonal pairs computed with the triangular mask
    (which cost more per entry in this kernel: the masked fill, and exp/log-sum-exp of -inf). Their sum is
    :func:`predicted_blocks`. Pure Python.

    Raises ValueError for an unknown method or cp < 1."""
    check_choice("method", method, METHODS)
    cp = positive_int("cp", cp)
    per_chunk = 1.0 / (2 if load_balance else 1) ** 2  # area of one chunk pair in blocks

    def split(pairs, share=1.0):
        diag = sum(1 for _, _, masked in pairs if masked)
        return ((len(pairs) - diag) * per_chunk * share, diag * per_chunk * share)

    if method == "ulysses":
        all_ids = [c for s in range(cp) for c in chunk_ids(s, cp, load_balance)]
        return [split(chunk_pairs(all_ids, all_ids, causal), 1.0 / cp)] * cp
    out = []
    for r in range(cp):
        pairs = [p for s in range(cp)
                 for p in chunk_pairs(chunk_ids(r, cp, load_balance), chunk_ids(s, cp, load_balance), causal)]
        out.append(split(pairs))
    return out


def predicted_blocks(cp: int, *, load_balance: bool = False, causal: bool = True, method: str = "ring") -> list[float]:
    """Attention work per rank, in blocks of (seq_len/cp)² score entries × all heads (forward; backward
    is proportional). A computed chunk pair counts fully, also on the diagonal (the kernel masks after
    computing). Ring / all-gather, causal, contiguous: rank r computes r+1 blocks (Brandon et al. 2023,
    §3); zigzag: (2·cp+1)/4 on every rank; non-causal: cp. Ulysses: every rank the whole sequence for
    heads/cp, so the same as the ring's mean.

    Raises ValueError for an unknown method or cp < 1."""
    return [f + d for f, d in predicted_pair_blocks(cp, load_balance=load_balance, causal=causal, method=method)]


def block_costs(*, batch: int, n_heads: int, block_len: int, head_dim: int, repeats: int = 5) -> dict:
    """Measured in this process, on one torch thread: CPU time of one block of ``block_len`` queries against
    ``block_len`` keys through this module's forward and backward kernels, unmasked (``full_ms``) and with
    the causal mask (``diagonal_ms``), the minimum over ``repeats`` (the least disturbed). fp32, random data.

    Returns ``{"full_ms", "diagonal_ms", "diagonal_over_full"}`` (measured). Raises ValueError for sizes < 1."""
    for name, v in (("batch", batch), ("n_heads", n_heads), ("block_len", block_len), ("head_dim", head_dim),
                    ("repeats", repeats)):
        positive_int(name, v)
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(batch, n_heads, block_len, head_dim, generator=g) for _ in range(4))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    best = {}
    try:
        for label, q_ids in (("full", [1]), ("diagonal", [0])):
            times = []
            for _ in range(repeats + 1):  # the first is a warm-up
                with count_work() as work:
                    out, lse = _new_out_lse(q)
                    _attend(q, k, v, q_ids, [0], True, out, lse)
                    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
                    _attend_backward(q, k, v, dout, lse, (dout * out).sum(-1), q_ids, [0], True, dq, dk, dv)
                times.append(work["kernel_cpu_ns"] / 1e6)
            best[label] = min(times[1:])
    finally:
        torch.set_num_threads(threads)
    return {"full_ms": best["full"], "diagonal_ms": best["diagonal"],
            "diagonal_over_full": best["diagonal"] / best["full"]}


#: measured zigzag max/min kernel time within this of 1 counts as "even" in :func:`imbalance`'s conclusion
EVEN_TOLERANCE = 0.15


def imbalance(table, costs: dict | None = None, *, method: str = "ring") -> dict:
    """The causal imbalance of contiguous (naive) sharding vs zigzag, from a :func:`profile_table` (the
    configs whose ``cp`` is the largest in the table, causal), for ``method``:

    * counted (deterministic): ``blocks_naive`` / ``blocks_zigzag`` per rank and ``counted_naive_ratio``
      (last rank / first rank: cp when the kernel computes r+1 blocks on rank r) and
      ``counted_zigzag_ratio`` (busiest / least busy: 1);
    * measured: ``kernel_cpu_ms_naive`` / ``kernel_cpu_ms_zigzag`` per rank (least-disturbed repeat) and the
      same two ratios, ``measured_naive_ratio`` and ``measured_zigzag_ratio``;
    * predicted: ``predicted_naive_ratio`` = cp from the block counts, and, with ``costs`` from
      :func:`block_costs`, ``predicted_weighted_naive_ratio``: the same with each diagonal block weighted by
      its measured cost relative to a full block;
    * ``shows_imbalance`` (bool): the measured naive ratio exceeds both 1.2 and the measured zigzag ratio
      by 0.15 — the timing shows what the counts say;
    * ``zigzag_even`` (bool): the measured zigzag max/min is within :data:`EVEN_TOLERANCE` of 1; only then
      does the conclusion say zigzag evened the work out, otherwise it says how far from even it stayed;
    * ``conclusion``: one sentence written from these numbers (what this run showed, not what it should).

    Raises ValueError when the table has no causal naive and zigzag rows of ``method`` at cp >= 2."""
    check_choice("method", method, METHODS)
    t = table[table["method"] == method]
    cp = int(t["cp"].max()) if len(t) else 0
    t = t[t["cp"] == cp]
    if cp < 2 or set(t["load_balance"]) != {False, True}:
        raise ValueError(f"imbalance() needs naive and zigzag rows of method={method!r} at cp >= 2 in the table; "
                         f"got cp={cp} with load_balance in {sorted(set(t['load_balance']))}")
    naive = t[~t["load_balance"]].sort_values("rank")
    zz = t[t["load_balance"]].sort_values("rank")
    out = {"method": method, "cp": cp,
           "blocks_naive": naive["blocks"].tolist(), "blocks_zigzag": zz["blocks"].tolist(),
           "kernel_cpu_ms_naive": naive["kernel_cpu_ms"].tolist(),
           "kernel_cpu_ms_zigzag": zz["kernel_cpu_ms"].tolist()}
    out["counted_naive_ratio"] = out["blocks_naive"][-1] / out["blocks_naive"][0]
    out["counted_zigzag_ratio"] = max(out["blocks_zigzag"]) / min(out["blocks_zigzag"])
    out["predicted_naive_ratio"] = float(cp)
    if costs is not None:
        w = costs["diagonal_over_full"]
        work = [f + w * d for f, d in predicted_pair_blocks(cp, method=method)]
        out["predicted_weighted_naive_ratio"] = work[-1] / work[0]
    cpu_n, cpu_z = out["kernel_cpu_ms_naive"], out["kernel_cpu_ms_zigzag"]
    timed = all(x == x for x in cpu_n + cpu_z)  # NaN on a GPU: no CPU kernel time
    out["measured_naive_ratio"] = cpu_n[-1] / cpu_n[0] if timed else float("nan")
    out["measured_zigzag_ratio"] = max(cpu_z) / min(cpu_z) if timed else float("nan")
    out["zigzag_even"] = bool(timed and out["measured_zigzag_ratio"] <= 1.0 + EVEN_TOLERANCE)
    out["shows_imbalance"] = bool(timed and out["measured_naive_ratio"] > 1.2
                                  and out["measured_naive_ratio"] > out["measured_zigzag_ratio"] + 0.15)
    counted = (f"Counted: with contiguous sharding the last of {cp} ranks computed "
               f"{out['counted_naive_ratio']:.2f}x the first rank's attention blocks (predicted {cp}), with "
               f"zigzag the busiest computed {out['counted_zigzag_ratio']:.2f}x the least busy (predicted 1). ")
    weighted = ""
    if "predicted_weighted_naive_ratio" in out:
        weighted = (f"; {out['predicted_weighted_naive_ratio']:.2f} once a masked diagonal block costs "
                    f"{costs['diagonal_over_full']:.2f}x a full one, as measured here")
    if not timed:
        timing = "Measured: no CPU kernel time on a GPU (kernels run asynchronously); read the timeline instead."
    else:
        ratios = (f"last/first {out['measured_naive_ratio']:.2f} naive (predicted {cp} from the counts{weighted}), "
                  f"max/min {out['measured_zigzag_ratio']:.2f} zigzag")
        if out["shows_imbalance"]:
            zz_ratio = out["measured_zigzag_ratio"]
            if out["zigzag_even"]:
                after = (f"zigzag evens the work out (its busiest rank within {zz_ratio - 1:.0%} of the least busy, "
                         f"tolerance {EVEN_TOLERANCE:.0%}).")
            else:
                after = (f"zigzag narrowed the spread but did not even it out: its busiest rank still took "
                         f"{zz_ratio - 1:.0%} more kernel time than the least busy (counted blocks: equal), more than "
                         f"the {EVEN_TOLERANCE:.0%} this lab calls even.")
            timing = ("Measured kernel CPU time (least-disturbed repeat) shows the imbalance in this run: "
                      f"{ratios}; " + after)
        else:
            timing = (f"Measured kernel CPU time (least-disturbed repeat) does NOT show the imbalance in this run: "
                      f"{ratios}. The counts above are exact; the timing was blurred, most likely by other "
                      "processes sharing the cores (re-run section 4, raise repeats or seq_len).")
    out["conclusion"] = counted + timing
    return out


def ring_schedule(cp: int, *, load_balance: bool = False, causal: bool = True) -> list[dict]:
    """The ring's plan as rows (pure Python): for each rank and ring step, the K/V block it holds (from rank
    ``(rank − step) mod cp``) and, for each (query chunk, key chunk) pair, ``"full"`` (computed, no mask),
    ``"diagonal"`` (computed with the triangular mask) or ``"skip"`` (entirely in the future)."""
    rows = []
    for r in range(cp):
        for step in range(cp):
            src = (r - step) % cp
            done = {(i, j): masked for i, j, masked in chunk_pairs(chunk_ids(r, cp, load_balance),
                                                                    chunk_ids(src, cp, load_balance), causal)}
            for i, qc in enumerate(chunk_ids(r, cp, load_balance)):
                for j, kc in enumerate(chunk_ids(src, cp, load_balance)):
                    kind = "skip" if (i, j) not in done else ("diagonal" if done[(i, j)] else "full")
                    rows.append({"rank": r, "step": step, "kv_from_rank": src, "q_chunk": qc, "k_chunk": kc,
                                 "kind": kind})
    return rows


def predicted_table(cps, *, batch: int, n_heads: int, seq_len: int, head_dim: int, element_size: int = 4,
                    methods=METHODS) -> list[dict]:
    """Predictions for each method and cp in ``cps`` (pure Python): bytes sent per rank for one forward +
    backward (:func:`predicted_comm_bytes`), bytes saved for backward (:func:`predicted_saved_bytes`), and the
    busiest rank's attention work over the mean, causal, naive and load-balanced (:func:`predicted_blocks`).
    Configurations that are not valid (e.g. Ulysses with cp > n_heads) are left out."""
    shape = {"batch": batch, "n_heads": n_heads, "seq_len": seq_len, "head_dim": head_dim,
             "element_size": element_size}
    rows = []
    for m in methods:
        for cp in cps:
            try:
                check_context_parallel(seq_len, cp, load_balance=True, method=m, n_heads=n_heads)
            except ValueError:
                continue
            b = predicted_comm_bytes(m, cp, **shape)
            naive = predicted_blocks(cp, method=m)
            lb = predicted_blocks(cp, method=m, load_balance=True)
            rows.append({"method": m, "cp": cp, "sent_bytes": b["forward"] + b["backward"],
                         "saved_bytes": predicted_saved_bytes(m, cp, **shape),
                         "max_over_mean_naive": max(naive) / (sum(naive) / cp),
                         "max_over_mean_balanced": max(lb) / (sum(lb) / cp)})
    return rows


def _check_shape(method: str, cp: int, **sizes) -> int:
    """Validate a (method, cp, shape) for the byte predictions; returns cp. ValueError names the value."""
    check_choice("method", method, METHODS)
    cp = positive_int("cp", cp)
    for name, value in sizes.items():
        positive_int(name, value)
    check_context_parallel(sizes["seq_len"], cp, method=method, n_heads=sizes["n_heads"])
    return cp


def predicted_comm_bytes(method: str, cp: int, *, batch: int, n_heads: int, seq_len: int, head_dim: int,
                         element_size: int = 4) -> dict[str, int]:
    """Bytes one rank sends for one attention forward and backward (bytes, int), with S = B·h·(T/cp)·d·e
    the size of one local q/k/v shard:

    * ring: forward (cp−1)·2S (K and V, cp−1 hops; Liu et al. 2023 §3); backward (cp−1)·2S for K/V again
      plus cp·2S for the travelling dK/dV accumulators.
    * allgather: forward all-gather of K,V: (cp−1)/cp · 2S·cp; backward reduce-scatter of dK,dV: the same
      (ring algorithm share, Patarasuk & Yuan 2009).
    * ulysses: forward all-to-all of q,k,v (3S) and of the output (S), each sending (cp−1)/cp of its input;
      backward the same (Jacobs et al. 2023 §3: 4 all-to-alls, volume falling as 1/cp per rank).

    Returns ``{"forward": bytes, "backward": bytes}`` (int).

    Raises:
        ValueError: unknown method; cp, batch, n_heads, seq_len, head_dim or element_size not an integer
            >= 1; cp not dividing seq_len; for Ulysses, cp not dividing n_heads (each message names the value
            and the valid ones, :func:`check_context_parallel`).
    """
    cp = _check_shape(method, cp, batch=batch, n_heads=n_heads, seq_len=seq_len, head_dim=head_dim,
                      element_size=element_size)
    s = batch * n_heads * (seq_len // cp) * head_dim * element_size
    if cp == 1:
        return {"forward": 0, "backward": 0}
    if method == "ring":
        return {"forward": (cp - 1) * 2 * s, "backward": (cp - 1) * 2 * s + cp * 2 * s}
    if method == "allgather":
        b = (cp - 1) * 2 * s
        return {"forward": b, "backward": b}
    b = round(4 * s * (cp - 1) / cp)
    return {"forward": b, "backward": b}


def predicted_saved_bytes(method: str, cp: int, *, batch: int, n_heads: int, seq_len: int, head_dim: int,
                          element_size: int = 4) -> int:
    """Bytes the attention kernel keeps for backward on one rank (q, k, v, out and the log-sum-exp):
    ring and Ulysses 4·B·h·(T/cp)·d·e + B·h·(T/cp)·e, all ``1/cp``; all-gather keeps the gathered K,V:
    2·B·h·(T/cp)·d·e + 2·B·h·T·d·e + B·h·(T/cp)·e. Counted from the tensors the kernels save (this module).

    Raises ValueError as :func:`predicted_comm_bytes` does."""
    cp = _check_shape(method, cp, batch=batch, n_heads=n_heads, seq_len=seq_len, head_dim=head_dim,
                      element_size=element_size)
    t = seq_len // cp
    shard = batch * n_heads * t * head_dim * element_size
    lse = batch * n_heads * t * element_size
    if method == "allgather" and cp > 1:
        return 2 * shard + 2 * batch * n_heads * seq_len * head_dim * element_size + lse
    return 4 * shard + lse


# ------------------------------------------------------------------------------------------------------
# rank functions (launch(labkit.parallel.context.<fn>, world_size, ...))
# ------------------------------------------------------------------------------------------------------
def all_cases(methods=METHODS) -> list[dict]:
    """Every (method, causal, load_balance) combination, as dicts for :func:`cp_parity_rank`."""
    return [{"method": m, "causal": c, "load_balance": lb} for m in methods for c in (True, False)
            for lb in (False, True)]


def _qkv(seed: int, batch: int, n_heads: int, seq_len: int, head_dim: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, n_heads, seq_len, head_dim, generator=g, dtype=torch.float64).to(dtype)
            for _ in range(4)]


def cp_parity_rank(ctx, cases: list[dict] | None = None, *, batch: int = 2, n_heads: int = 4, seq_len: int = 32,
                   head_dim: int = 8, seed: int = 0, model_cases: list[dict] = (),
                   spec: str = "lab-tiny-llama") -> dict:
    """Rank function: CP attention vs full-sequence ``F.scaled_dot_product_attention``, forward and backward.

    Every rank draws the same full q, k, v and output gradient (fp32, from ``seed``), computes the reference
    with sdpa + autograd, runs each case of ``cases`` (dicts with method, causal, load_balance; default
    :func:`all_cases`) on its shard and compares out, dq, dk, dv with the reference rows
    (``labkit.models.TOLERANCES[torch.float32]``: rtol 1e-4, atol 1e-5).

    ``model_cases`` (dicts with method, load_balance): the whole ``spec`` transformer with CP attention,
    loss and weight gradients (summed over ranks) vs the single-process model on the full sequence.

    Returns ``{"attention": [row per case], "model": [row per model case]}``; each row has the case, ``cp``,
    ``max_abs_err`` per tensor and ``ok`` (every tensor within tolerance).
    """
    import torch.nn.functional as F

    from labkit.models import TOLERANCES

    tol = TOLERANCES[torch.float32]
    cp, r = ctx.world_size, ctx.rank
    q, k, v, dout = (t.to(ctx.device) for t in _qkv(seed, batch, n_heads, seq_len, head_dim))
    refs = {}
    for causal in (True, False):
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
        out.backward(dout)
        refs[causal] = {"out": out.detach(), "dq": qr.grad, "dk": kr.grad, "dv": vr.grad}
    rows = []
    for case in cases if cases is not None else all_cases():
        lb, causal = case["load_balance"], case["causal"]
        sh = [shard_sequence(t, cp, r, lb).clone() for t in (q, k, v, dout)]
        ql, kl, vl = (t.requires_grad_() for t in sh[:3])
        out = context_parallel_attention(ql, kl, vl, method=case["method"], causal=causal, load_balance=lb)
        out.backward(sh[3])
        got = {"out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad}
        ref = {n: shard_sequence(t, cp, r, lb) for n, t in refs[causal].items()}
        err = {n: float((got[n] - ref[n]).abs().max()) for n in got}
        ok = all(torch.allclose(got[n], ref[n], **tol) for n in got)
        rows.append({**case, "cp": cp, "rank": r, **{f"err_{n}": e for n, e in err.items()}, "ok": ok})
    model_rows = [_model_parity(ctx, spec, mc["method"], mc["load_balance"], seed, tol) for mc in model_cases]
    return {"attention": rows, "model": model_rows}


def _model_parity(ctx, spec_name, method, load_balance, seed, tol) -> dict:
    from labkit.models import SyntheticLM, build_model, lm_loss
    from labkit.theory.spec import get_spec

    spec = get_spec(spec_name)
    cp, r = ctx.world_size, ctx.rank
    seq_len = 4 * cp * 2
    tokens, targets = (t.to(ctx.device) for t in SyntheticLM(spec.vocab_size, seq_len, seed).batch(0, 2))
    ref_model = build_model(spec, seed, device=ctx.device)
    ref_logits = ref_model(tokens)
    lm_loss(ref_logits, targets).backward()
    model = apply_context_parallel(build_model(spec, seed, device=ctx.device), method, load_balance=load_balance)
    pos = shard_positions(seq_len, cp, r, load_balance).to(ctx.device)
    logits = model(tokens[:, pos], positions=pos)
    # the global mean loss = sum over every rank's tokens / all tokens
    loss_part = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[:, pos].reshape(-1),
                                                  reduction="sum") / targets.numel()
    loss_part.backward()
    err_grad, ok = 0.0, True
    for p, pr in zip(model.parameters(), ref_model.parameters()):
        dist.all_reduce(p.grad)  # weights are replicated over the CP group: sum their gradients
        err_grad = max(err_grad, float((p.grad - pr.grad).abs().max()))
        ok &= torch.allclose(p.grad, pr.grad, **tol)
    loss = loss_part.detach().clone()
    dist.all_reduce(loss)
    ref_loss = lm_loss(ref_logits, targets).detach()
    logits, ref_logits = logits.detach(), ref_logits.detach()
    err_logits = float((logits - ref_logits[:, pos]).abs().max())
    ok &= torch.allclose(logits, ref_logits[:, pos], **tol) and torch.allclose(loss, ref_loss, **tol)
    return {"spec": spec_name, "method": method, "load_balance": load_balance, "cp": cp, "rank": r,
            "err_logits": err_logits, "err_loss": float((loss - ref_loss).abs()), "err_grad": err_grad, "ok": ok}


def _profile_once(q, k, v, dout, method, causal, lb, group, timeline=None, log=None) -> int:
    """One forward + backward of CP attention; returns the bytes saved for backward."""
    from labkit.runtime.measure import SavedActivations

    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    with log.tagged("forward") if log else contextlib.nullcontext():
        # no module to attribute to: every saved storage of the attention call counts once
        with SavedActivations(torch.nn.Module(), layers=[], keep_items=False) as saved:
            out = context_parallel_attention(ql, kl, vl, method=method, causal=causal, load_balance=lb,
                                             group=group, timeline=timeline)
    with log.tagged("backward") if log else contextlib.nullcontext():
        out.backward(dout)
    return saved.total_bytes


def cp_profile_rank(ctx, configs: list[dict], *, batch: int = 1, n_heads: int = 4, seq_len: int = 1024,
                    head_dim: int = 32, causal: bool = True, repeats: int = 3, seed: int = 0) -> list[dict]:
    """Rank function: measure CP attention (forward + backward) for each config.

    ``configs``: dicts with ``method``, ``load_balance`` and optionally ``cp`` (a divisor of world_size,
    default world_size; with cp < world_size the ranks form world_size/cp independent CP groups of
    consecutive ranks, all running at once). On CPU torch runs on one thread for the whole profile (restored
    afterwards), so a thread's CPU time is all of its compute and ranks do not compete with their own threads.

    Per config and rank, measured: ``saved_bytes`` (storages autograd saves for the attention's backward,
    bytes, :class:`labkit.runtime.measure.SavedActivations`),
    ``score_entries`` (attention scores the forward kernel computed, :func:`count_work`: a count),
    ``fwd_bytes`` / ``bwd_bytes`` (bytes this rank sends, from :class:`labkit.runtime.commlog.CommLog`),
    ``kernel_cpu_ns`` (per repeat: CPU time inside the forward and backward block kernels,
    :func:`count_work`; None on a GPU, where kernels run asynchronously), ``compute_ns`` (per repeat: the
    rank's attention compute events, wall ns), ``cpu_ns`` (per repeat: CPU time of the rank's thread over
    the whole iteration, ``time.thread_time_ns``, communication bookkeeping included), ``iter_ns`` (per
    repeat, barrier to end of backward) and ``window_ns`` (start, end of the timed repeats on the timeline's
    clock), plus the events in ``ctx.timeline`` (``stage`` = ring step). One warm-up iteration precedes the
    timed ones.

    Raises ValueError (before any collective) for a cp that does not divide world_size or a configuration
    :func:`check_context_parallel` rejects.
    """
    from labkit.runtime import timeline as tl
    from labkit.runtime.commlog import CommLog

    for cfg in configs:  # every rank validates every config before the first collective
        c = cfg.get("cp", ctx.world_size)
        check_divides("cp", c, "world_size", ctx.world_size)
        check_context_parallel(seq_len, c, load_balance=cfg["load_balance"], method=cfg["method"],
                               n_heads=n_heads)
    groups = {}
    for cfg in configs:  # every rank creates the same groups in the same order
        c = cfg.get("cp", ctx.world_size)
        if c not in groups:
            groups[c] = dist.new_subgroups(group_size=c)[0]
    full = [t.to(ctx.device) for t in _qkv(seed, batch, n_heads, seq_len, head_dim)]
    threads = torch.get_num_threads()
    if not ctx.is_cuda:
        torch.set_num_threads(1)
    rows = []
    try:
        for i, cfg in enumerate(configs):
            rows.append(_profile_config(ctx, i, cfg, groups, full, causal, repeats, tl, CommLog))
    finally:
        torch.set_num_threads(threads)
    return rows


def _profile_config(ctx, i, cfg, groups, full, causal, repeats, tl, CommLog) -> dict:
    method, lb = cfg["method"], cfg["load_balance"]
    c = cfg.get("cp", ctx.world_size)
    group = groups[c]
    gr = dist.get_rank(group)
    q, k, v, dout = (shard_sequence(t, c, gr, lb).contiguous() for t in full)

    args = (q, k, v, dout, method, causal, lb, group)
    _profile_once(*args)  # warm-up
    with CommLog() as log, count_work() as work:
        saved_bytes = _profile_once(*args, log=log)
    comm = log.to_frame()
    sent = comm.groupby("tag")["bytes_per_rank"].sum() if len(comm) else {}
    compute_ns, iter_ns, cpu_ns, kernel_ns = [], [], [], []
    ctx.barrier()
    w0 = tl.now_ns()
    for _ in range(repeats):
        ctx.barrier()
        n0 = len(ctx.timeline.events)
        t0, c0 = tl.now_ns(), time.thread_time_ns()
        with count_work() as timed:
            _profile_once(*args, timeline=ctx.timeline)
        cpu_ns.append(time.thread_time_ns() - c0)
        iter_ns.append(tl.now_ns() - t0)
        kernel_ns.append(timed["kernel_cpu_ns"])
        ev = ctx.timeline.events[n0:]
        compute_ns.append(sum(e[4] - e[3] for e in ev if e[2] == "compute"))
    w1 = tl.now_ns()
    ctx.barrier()
    return {"config": i, "method": method, "load_balance": lb, "cp": c, "rank": ctx.rank, "cp_rank": gr,
            "causal": causal, "saved_bytes": saved_bytes, "score_entries": work["score_entries"],
            "fwd_bytes": int(sent.get("forward", 0)), "bwd_bytes": int(sent.get("backward", 0)),
            "kernel_cpu_ns": None if ctx.is_cuda else kernel_ns, "compute_ns": compute_ns, "cpu_ns": cpu_ns,
            "iter_ns": iter_ns, "window_ns": (w0 - ctx.clock_offset_ns, w1 - ctx.clock_offset_ns)}


# ------------------------------------------------------------------------------------------------------
# tables for the chapter (measured beside predicted)
# ------------------------------------------------------------------------------------------------------
def profile_table(result, *, batch: int, n_heads: int, seq_len: int, head_dim: int, element_size: int = 4):
    """One row per (config, rank) of a :func:`cp_profile_rank` launch, measured beside predicted:

    ``blocks`` (score entries the kernel computed / (B·heads·(T/cp)²): counted, the same on every run) beside
    ``predicted_blocks`` (:func:`predicted_blocks`); ``kernel_cpu_ms`` (CPU time inside the block kernels,
    forward + backward, the minimum over repeats: the least disturbed, measured; NaN on a GPU);
    ``compute_ms`` (wall time of the compute events, median over repeats, measured); ``cpu_ms`` (thread CPU
    time of the whole iteration, minimum over repeats, measured); ``compute_share`` (this rank's
    ``kernel_cpu_ms`` / its group's mean, measured; on a GPU ``compute_ms`` instead) beside
    ``predicted_share`` (:func:`predicted_blocks` / mean); ``saved_bytes`` beside ``predicted_saved_bytes``;
    ``sent_bytes`` (forward + backward, measured) beside ``predicted_sent_bytes``
    (:func:`predicted_comm_bytes`)."""
    import statistics

    import pandas as pd

    rows = [row for rank_rows in result for row in rank_rows]
    df = pd.DataFrame(rows)
    df["kernel_cpu_ms"] = df["kernel_cpu_ns"].map(lambda xs: min(xs) / 1e6 if xs else float("nan"))
    df["compute_ms"] = df["compute_ns"].map(lambda xs: statistics.median(xs) / 1e6)
    df["cpu_ms"] = df["cpu_ns"].map(lambda xs: min(xs) / 1e6)
    df["iter_ms"] = df["iter_ns"].map(lambda xs: statistics.median(xs) / 1e6)
    df["group"] = df["rank"] // df["cp"]
    work = df["kernel_cpu_ms"].where(df["kernel_cpu_ms"].notna(), df["compute_ms"])
    df["compute_share"] = work / work.groupby([df["config"], df["group"]]).transform("mean")
    df["blocks"] = df["score_entries"] / (batch * n_heads * (seq_len // df["cp"]) ** 2)
    pred_share, pred_blocks, pred_saved, pred_sent = [], [], [], []
    for row in df.itertuples():
        blocks = predicted_blocks(row.cp, load_balance=row.load_balance, causal=row.causal, method=row.method)
        pred_blocks.append(blocks[row.cp_rank])
        pred_share.append(blocks[row.cp_rank] / (sum(blocks) / len(blocks)))
        shape = {"batch": batch, "n_heads": n_heads, "seq_len": seq_len, "head_dim": head_dim,
                 "element_size": element_size}
        pred_saved.append(predicted_saved_bytes(row.method, row.cp, **shape))
        pb = predicted_comm_bytes(row.method, row.cp, **shape)
        pred_sent.append(pb["forward"] + pb["backward"])
    df["predicted_share"] = pred_share
    df["predicted_blocks"] = pred_blocks
    df["predicted_saved_bytes"] = pred_saved
    df["sent_bytes"] = df["fwd_bytes"] + df["bwd_bytes"]
    df["predicted_sent_bytes"] = pred_sent
    cols = ["config", "method", "load_balance", "cp", "rank", "blocks", "predicted_blocks", "kernel_cpu_ms",
            "compute_ms", "cpu_ms", "compute_share", "predicted_share", "iter_ms", "saved_bytes",
            "predicted_saved_bytes", "fwd_bytes", "bwd_bytes", "sent_bytes", "predicted_sent_bytes"]
    return df[cols]


def config_timeline(result, config: int):
    """The events of one config of a :func:`cp_profile_rank` launch (a slice of ``result.timeline``)."""
    rows = [row for rank_rows in result for row in rank_rows if row["config"] == config]
    start = min(r["window_ns"][0] for r in rows)
    end = max(r["window_ns"][1] for r in rows)
    df = result.timeline
    return df[(df["start_ns"] >= start) & (df["end_ns"] <= end)].reset_index(drop=True)
