"""Context parallelism, predicted: which chunks a rank holds, which chunk pairs it computes, and the work,
bytes sent and bytes kept for backward per rank. Pure Python (no torch).

The strategy (:mod:`labkit.parallel.context`) runs the same plan: its sharding and its blockwise kernel call
:func:`chunk_ids` and :func:`chunk_pairs` from here, so the prediction and the kernel cannot disagree on which
blocks exist.

Sharding (``load_balance``): the sequence is cut into ``cp`` chunks (contiguous, rank r holds chunk r) or
``2·cp`` chunks (load-balanced "zigzag"/head-tail: rank r holds chunks r and 2·cp−1−r; Megatron-LM CP,
Llama 3, Dubey et al. 2024, §3.3.2). With causal attention, contiguous sharding gives rank r ``r+1`` blocks of
work and the last rank ``cp`` times the first's; zigzag gives every rank the same ``(2·cp+1)/4`` blocks.
Causal masking is decided per *chunk pair* from the chunks' global positions: only the diagonal is masked.
"""

from __future__ import annotations

from labkit.checks import check_choice, check_divides, positive_int

METHODS = ("ring", "allgather", "ulysses")
MASK_POLICIES = ("diagonal", "every_block")


# ------------------------------------------------------------------------------------------------------
# validation and sharding (index arithmetic)
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


def n_chunks(cp: int, load_balance: bool = False) -> int:
    """Number of equal sequence chunks: ``cp`` (contiguous) or ``2·cp`` (load-balanced)."""
    return 2 * cp if load_balance else cp


def chunk_ids(rank: int, cp: int, load_balance: bool = False) -> list[int]:
    """Global chunk indices held by ``rank``: ``[rank]`` or ``[rank, 2·cp−1−rank]`` (zigzag)."""
    if not 0 <= rank < cp:
        raise ValueError(f"rank={rank} must be in 0..{cp - 1}")
    return [rank, 2 * cp - 1 - rank] if load_balance else [rank]


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


# ------------------------------------------------------------------------------------------------------
# work per rank
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


# ------------------------------------------------------------------------------------------------------
# bytes sent and bytes kept for backward
# ------------------------------------------------------------------------------------------------------
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
    2·B·h·(T/cp)·d·e + 2·B·h·T·d·e + B·h·(T/cp)·e. Counted from the tensors the kernels save
    (:mod:`labkit.parallel.context`).

    Raises ValueError as :func:`predicted_comm_bytes` does."""
    cp = _check_shape(method, cp, batch=batch, n_heads=n_heads, seq_len=seq_len, head_dim=head_dim,
                      element_size=element_size)
    t = seq_len // cp
    shard = batch * n_heads * t * head_dim * element_size
    lse = batch * n_heads * t * element_size
    if method == "allgather" and cp > 1:
        return 2 * shard + 2 * batch * n_heads * seq_len * head_dim * element_size + lse
    return 4 * shard + lse


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


# ------------------------------------------------------------------------------------------------------
# charging a lab-sized attention run as a real model's attention layer (chapter 07's emulated run)
# ------------------------------------------------------------------------------------------------------
def attention_charge(*, model: str = "llama-3-8b", seq_len: int = 8192, lab_seq_len: int, lab_n_heads: int,
                     lab_head_dim: int, dtype: str = "bf16", lab_dtype: str = "fp32"):
    """The :class:`labkit.theory.replay.Charge` that makes one run of the lab's context-parallel attention
    (``lab_n_heads`` heads of ``lab_head_dim``, ``lab_seq_len`` tokens, in ``lab_dtype``) cost what ONE
    attention layer of ``model`` would at ``seq_len`` tokens in ``dtype`` (forward + backward), for the same cp.
    Unlike :func:`labkit.theory.replay.model_charge` (whole-model FLOPs per token), only attention is scaled:

    * compute FLOPs x (T/T_l)² · (h·d)/(h_l·d_l) (every score entry is a d-long dot product, per head);
    * compute bytes x (T/T_l)² · h/h_l · e/e_l (most memory-bound work is on the score matrices; operations on
      q/k/v-sized tensors — copying chunks, merging outputs — are charged at this ratio too, an upper bound);
    * the ring's K/V point-to-point bytes x (T/T_l) · (h_kv·d)/(h_l·d_l) · e/e_l (grouped-query attention sends
      ``n_kv_heads``, the lab sends every head), once.

    Pure Python. Raises ValueError for an unknown model, a size < 1, a seq_len beyond the model's
    ``max_seq_len`` or an unknown dtype."""
    from labkit.theory.replay import DTYPE_BYTES, Charge
    from labkit.theory.spec import get_spec

    spec = get_spec(model)
    t = spec.check_seq_len(seq_len, "seq_len")
    tl_, hl, dl = (positive_int(n, v) for n, v in (("lab_seq_len", lab_seq_len), ("lab_n_heads", lab_n_heads),
                                                    ("lab_head_dim", lab_head_dim)))
    check_choice("dtype", dtype, DTYPE_BYTES)
    check_choice("lab_dtype", lab_dtype, DTYPE_BYTES)
    e = DTYPE_BYTES[dtype] / DTYPE_BYTES[lab_dtype]
    f_flops = (t / tl_) ** 2 * (spec.n_heads * spec.head_dim) / (hl * dl)
    f_bytes = (t / tl_) ** 2 * spec.n_heads / hl * e
    f_kv = t / tl_ * (spec.n_kv_heads * spec.head_dim) / (hl * dl) * e
    details = {"model": spec.name, "what": "one attention layer, forward + backward", "seq_len": t, "dtype": dtype,
               "lab_seq_len": tl_, "lab_n_heads": hl, "lab_head_dim": dl, "lab_dtype": lab_dtype,
               "flops_factor": f_flops, "bytes_factor": f_bytes, "kv_bytes_factor": f_kv}
    return Charge(f"as {spec.name}", f_flops, f_bytes, dtype, {"cp": (f_kv, 1.0), "pp": (f_kv, 1.0)}, "cp", {},
                  details)
