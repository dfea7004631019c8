"""Tensor and sequence parallelism, predicted: what a tp degree needs of a model, and what it communicates.

Pure Python (no torch), written once for the strategy (:mod:`labkit.parallel.tensor`), its experiments and
chapters 05 and 10:

* :func:`check_tp` (every bad tp as a ValueError before any launch), :func:`kv_plan` (GQA kv heads split or
  replicated), :func:`pad_vocab_size` (Megatron-LM's vocabulary padding);
* :func:`comm_theory_per_layer`, :func:`comm_theory_model`, :func:`comm_theory_mlp_pair`: the collectives of a
  layer, of a whole training step, of a two-matmul MLP (Shoeybi et al. 2019, "Megatron-LM", Figure 4;
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Figure 5);
  :func:`collectives_per_forward` (one forward pass, as a server runs it) and :func:`step_ring_bytes`;
* :func:`activation_bytes_predicted`: saved activations per rank with TP and SP (Korthikanti et al. 2022,
  Table 2, itemised for the lab's model by :mod:`labkit.theory.memory`).
"""

from __future__ import annotations

from labkit.checks import check_choice, check_divides, positive_int
from labkit.theory import costmodel
from labkit.theory import memory as mem
from labkit.theory.spec import ModelSpec, get_spec


def pad_vocab_size(vocab_size: int, tp: int, multiple: int = 1) -> int:
    """The smallest multiple of ``tp * multiple`` >= vocab_size (Megatron-LM pads to a multiple of
    ``make_vocab_size_divisible_by * tp``, default 128 * tp, so the vocabulary splits evenly).
    Raises ValueError for non-positive arguments."""
    vocab_size = positive_int("vocab_size", vocab_size)
    step = positive_int("tp", tp) * positive_int("multiple", multiple)
    return -(-vocab_size // step) * step


def kv_plan(n_heads: int, n_kv_heads: int, tp: int) -> str:
    """``"split"`` when tp divides n_kv_heads, ``"replicate"`` when n_kv_heads < tp and divides it (each kv
    head is kept by the tp/n_kv_heads ranks whose query heads use it). Raises ValueError otherwise."""
    mem.kv_heads_per_rank(n_heads, n_kv_heads, tp)  # the one rule (memory, mesh, this module); raises ValueError
    return "split" if n_kv_heads % tp == 0 else "replicate"


def check_tp(spec: ModelSpec | str, tp: int, *, pad_vocab: bool = False, sequence_parallel: bool = False,
             seq_len: int | None = None, dtensor: bool = False, kv_cache: bool = False) -> dict:
    """Validate tensor parallelism of degree ``tp`` for ``spec`` before anything is launched.

    Returns the plan: ``{"tp", "kv": "split" | "replicate", "vocab_size", "padded_vocab_size",
    "sequence_parallel"}``.

    Raises ValueError naming the value and the valid choices when tp does not divide n_heads, ffn_hidden_size
    or vocab_size (unless ``pad_vocab``: the message offers it), when the kv heads can be neither split nor
    replicated, when ``sequence_parallel`` and tp does not divide ``seq_len``, when dropout > 0 (needs a
    per-region RNG, not implemented), and for the DTensor variant (``dtensor=True``) when the kv heads would
    need replicating, the embeddings are tied, or SP meets learned positions. ``kv_cache=True`` (serving,
    :mod:`labkit.parallel.serving`): tp must divide n_kv_heads, since every rank keeps its own kv heads' cache, as
    :func:`labkit.theory.memory.kv_cache_bytes` counts it (replicated kv heads are not served).
    """
    if isinstance(spec, str):
        spec = get_spec(spec)
    tp = positive_int("tp", tp)
    check_divides("tp", tp, "n_heads", spec.n_heads)
    if kv_cache:
        check_divides("tp", tp, "n_kv_heads", spec.n_kv_heads,
                      hint=f"model {spec.name!r}: the KV cache is split by kv heads")
    kv = kv_plan(spec.n_heads, spec.n_kv_heads, tp)
    check_divides("tp", tp, "ffn_hidden_size", spec.ffn_hidden_size)
    vp = pad_vocab_size(spec.vocab_size, tp)
    if spec.vocab_size % tp and not pad_vocab:
        check_divides("tp", tp, "vocab_size", spec.vocab_size,
                      hint=f"or pad the vocabulary to {vp} with pad_vocab=True (Megatron-LM pads to a multiple "
                           "of 128*tp)")
    if sequence_parallel and seq_len is not None:
        check_divides("tp", tp, "seq_len", positive_int("seq_len", seq_len),
                      hint="sequence parallelism splits the sequence")
    if spec.dropout:
        raise ValueError(f"dropout={spec.dropout} is not supported with tensor parallelism here: dropout inside "
                         "a TP region needs a different random stream per rank and outside it the same one "
                         "(Megatron-LM's RNG tracker); use dropout=0")
    if dtensor:
        if kv != "split":
            raise ValueError(f"the DTensor variant shards wk/wv with ColwiseParallel, which needs tp to divide "
                             f"n_kv_heads={spec.n_kv_heads}; tp={tp} would need replicated kv heads (hand TP "
                             "does that: apply_tp)")
        if spec.tied_embeddings:
            raise ValueError("the DTensor variant does not support tied embeddings (the head would reuse a "
                             "Shard(0) DTensor weight on a plain tensor); use apply_tp")
        if spec.vocab_size % tp:
            check_divides("tp", tp, "vocab_size", spec.vocab_size, hint="the DTensor variant does not pad")
        if sequence_parallel and spec.position == "learned":
            raise ValueError("the DTensor variant with sequence_parallel=True supports RoPE models only "
                             f"(position={spec.position!r} adds a plain tensor to a Shard(1) DTensor)")
    return {"tp": tp, "kv": kv, "vocab_size": spec.vocab_size, "padded_vocab_size": vp if spec.vocab_size % tp
            else spec.vocab_size, "sequence_parallel": sequence_parallel}


# ------------------------------------------------------------------------------------------------------
# collectives per layer, per training step, per forward pass
# ------------------------------------------------------------------------------------------------------
def _row(where: str, phase: str, op: str, calls: int, nbytes: int, n: int, why: str) -> dict:
    return {"where": where, "phase": phase, "op": op, "calls": calls, "nbytes": nbytes,
            "bytes_per_rank": calls * nbytes * costmodel.bus_factor(op, n), "why": why}


def comm_theory_per_layer(batch_size: int, seq_len: int, hidden_size: int, tp: int, *,
                          sequence_parallel: bool = False, regather: bool = True, bytes_per_element: int = 4,
                          where: str = "layer") -> list[dict]:
    """Predicted collectives of one transformer layer, forward and backward (one row per phase and op).

    Each row: ``where``, ``phase`` (fwd/bwd), ``op``, ``calls``, ``nbytes`` (S per call, nccl-tests
    convention: S = B*T*H*bytes_per_element for every call here), ``bytes_per_rank`` (calls x S x ring factor:
    all-reduce 2(tp-1)/tp, all-gather / reduce-scatter (tp-1)/tp), ``why``.

    TP (Shoeybi et al. 2019, Figure 4): forward 2 all-reduces (``g`` after attention and after the MLP),
    backward 2 (``f`` before each). SP (Korthikanti et al. 2022, Section 4.2.2, Figure 5): each all-reduce
    becomes an all-gather + a reduce-scatter of the same S, so the same bytes per rank on a ring
    (2(tp-1)/tp = 2 x (tp-1)/tp); with ``regather`` the backward adds one all-gather per column region to
    rebuild the stored sequence shard. Raises ValueError for non-positive sizes.
    """
    s = (positive_int("batch_size", batch_size) * positive_int("seq_len", seq_len)
         * positive_int("hidden_size", hidden_size) * positive_int("bytes_per_element", bytes_per_element))
    n = positive_int("tp", tp)
    if not sequence_parallel:
        return [_row(where, "fwd", "all_reduce", 2, s, n, "g after the attention and after the MLP"),
                _row(where, "bwd", "all_reduce", 2, s, n, "f before the attention and before the MLP")]
    rows = [_row(where, "fwd", "all_gather", 2, s, n, "sequence -> whole before attention and MLP"),
            _row(where, "fwd", "reduce_scatter", 2, s, n, "partial sums -> sequence shard after attention, MLP"),
            _row(where, "bwd", "all_gather", 2 + (2 if regather else 0), s, n,
                 "transpose of the forward reduce-scatters" + (" + re-gather of the 2 stored input shards"
                                                              if regather else "")),
            _row(where, "bwd", "reduce_scatter", 2, s, n, "transpose of the forward all-gathers")]
    return rows


def comm_theory_model(spec: ModelSpec | str, batch_size: int, seq_len: int, tp: int, *,
                      sequence_parallel: bool = False, regather: bool = True, bytes_per_element: int = 4) -> list[dict]:
    """Predicted collectives of one training step (forward, vocab-parallel loss, backward, gradient
    finalisation) of :class:`labkit.parallel.tensor.TPTransformer`, with the ``where`` tags the model uses
    (``embed``, ``layer{i}``, ``head``, ``loss``, ``finalize``). Rows as :func:`comm_theory_per_layer`.

    Beyond the layers: the vocab-parallel embedding ends with ``g`` (SP: a reduce-scatter; its backward an
    all-gather); the column-parallel output layer starts with ``f`` (SP: all-gather, re-gathered in the
    backward); the loss exchanges 3 fp32 numbers per token in 2 all-reduces (max, then the (target logit,
    sum of exponentials) pair) instead of gathering B*T*V logits; ``finalize_grads`` all-reduces the
    partial gradients (SP norms, row biases, learned positions; replicated kv heads) in one call.
    Raises ValueError as :func:`check_tp` (with the vocabulary padded) for a tp the model cannot use.
    """
    if isinstance(spec, str):
        spec = get_spec(spec)
    plan = check_tp(spec, tp, pad_vocab=True, sequence_parallel=sequence_parallel, seq_len=seq_len)
    n, e = plan["tp"], bytes_per_element
    s = batch_size * seq_len * spec.hidden_size * e
    rows = []
    if n == 1:
        return rows
    sp = sequence_parallel
    rows.append(_row("embed", "fwd", "reduce_scatter" if sp else "all_reduce", 1, s, n, "vocab-parallel embedding"))
    if sp:
        rows.append(_row("embed", "bwd", "all_gather", 1, s, n, "transpose of the embedding reduce-scatter"))
    for i in range(spec.n_layers):
        rows += comm_theory_per_layer(batch_size, seq_len, spec.hidden_size, n, sequence_parallel=sp,
                                      regather=regather, bytes_per_element=e, where=f"layer{i}")
    if sp:
        rows.append(_row("head", "fwd", "all_gather", 1, s, n, "sequence -> whole before the output layer"))
        if regather:
            rows.append(_row("head", "bwd", "all_gather", 1, s, n, "re-gather of the stored shard"))
        rows.append(_row("head", "bwd", "reduce_scatter", 1, s, n, "transpose of the forward all-gather"))
    else:
        rows.append(_row("head", "bwd", "all_reduce", 1, s, n, "f before the column-parallel output layer"))
    tokens = batch_size * seq_len
    loss_sizes = [tokens * 4, 2 * tokens * 4]  # fp32: the max, then the (target logit, sum exp) pair
    rows.append({"where": "loss", "phase": "fwd", "op": "all_reduce", "calls": 2, "nbytes": None,
                 "nbytes_list": loss_sizes, "bytes_per_rank": sum(loss_sizes) * 2 * (n - 1) / n,
                 "why": "max; (target logit, sum exp) pair: 3 numbers per token, not V"})
    fin = 0
    d, h = spec.head_dim, spec.hidden_size
    if sp:
        fin += spec.n_layers * 2 * spec.norm_params() + spec.norm_params()
        fin += spec.n_layers * 2 * h if spec.bias else 0
        fin += spec.max_seq_len * h if spec.position == "learned" else 0
    if plan["kv"] == "replicate":
        per_head = d * h + (d if spec.bias else 0)
        fin += spec.n_layers * 2 * spec.n_kv_heads * per_head
    if fin:
        rows.append(_row("finalize", "bwd", "all_reduce", 1, fin * e, n,
                         "partial gradients: " + ", ".join(
                             ([f"SP norms{' and biases' if spec.bias else ''}"] if sp else [])
                             + (["learned positions"] if sp and spec.position == "learned" else [])
                             + (["replicated kv heads"] if plan["kv"] == "replicate" else []))))
    return rows


def collectives_per_forward(spec: ModelSpec | str, tp: int, *, gather_logits: bool = True) -> dict:
    """*Predicted* collectives of one TP forward pass without the loss (a prefill, or one decode step for the
    whole batch), counted from the forward rows of :func:`comm_theory_model`: ``all_reduce`` = 2 per layer
    (after attention, after the MLP; Shoeybi et al. 2019, Sec. 3) + 1 (the vocabulary-parallel embedding),
    ``all_gather`` = 1 when ``gather_logits`` (the vocabulary-split logits, gathered to sample). Zero for
    tp = 1. Raises ValueError as :func:`check_tp` (vocabulary padded) for a tp the model cannot use."""
    if positive_int("tp", tp) == 1:
        return {"all_reduce": 0, "all_gather": 0}
    fwd = [r for r in comm_theory_model(spec, 1, 1, tp) if r["phase"] == "fwd" and r["where"] != "loss"]
    return {"all_reduce": sum(r["calls"] for r in fwd if r["op"] == "all_reduce"),
            "all_gather": sum(r["calls"] for r in fwd if r["op"] == "all_gather") + (1 if gather_logits else 0)}


def comm_theory_mlp_pair(kind: str, tokens: int, hidden_size: int, ffn_hidden_size: int, tp: int,
                         bytes_per_element: int = 4) -> list[dict]:
    """Collectives of a two-matmul MLP from a replicated input to a replicated output, forward + backward.

    ``"column-row"`` (Megatron): forward one all-reduce of the [tokens, H] output, backward one of the input
    gradient. ``"column-column"``: the second column layer needs the whole [tokens, F] activation, so the
    first output is all-gathered (the extra collective column->row avoids), then the second output too;
    backward: ``f`` before each column layer (2 all-reduces, the first of size [tokens, F]).
    Raises ValueError for an unknown kind.
    """
    check_choice("kind", kind, ("column-row", "column-column"))
    n = positive_int("tp", tp)
    sh = positive_int("tokens", tokens) * positive_int("hidden_size", hidden_size) * bytes_per_element
    sf = tokens * positive_int("ffn_hidden_size", ffn_hidden_size) * bytes_per_element
    if kind == "column-row":
        return [_row(kind, "fwd", "all_reduce", 1, sh, n, "g after the row layer"),
                _row(kind, "bwd", "all_reduce", 1, sh, n, "f before the column layer")]
    rows = [_row(kind, "fwd", "all_gather", 1, sf, n, "the second column layer needs the whole activation; "
                 "then the whole output"),
            _row(kind, "bwd", "all_reduce", 1, sf, n, "f before the second column layer; f before the first")]
    for row in rows:  # two calls of different sizes each: [tokens, F] and [tokens, H]
        per_byte = row["bytes_per_rank"] / sf
        row.update(calls=2, nbytes=None, nbytes_list=sorted([sf, sh]), bytes_per_rank=per_byte * (sf + sh))
    return rows


def step_ring_bytes(spec: ModelSpec | str, batch_size: int, seq_len: int, tp: int, *, sequence_parallel: bool,
                    regather: bool = True) -> float:
    """Bytes one rank sends on a ring in one training step: the sum of :func:`comm_theory_model`'s
    ``bytes_per_rank``. Raises ValueError as :func:`comm_theory_model`."""
    return sum(r["bytes_per_rank"] for r in comm_theory_model(spec, batch_size, seq_len, tp,
                                                              sequence_parallel=sequence_parallel, regather=regather))


# ------------------------------------------------------------------------------------------------------
# activation memory
# ------------------------------------------------------------------------------------------------------
def activation_bytes_predicted(spec: ModelSpec | str, batch_size: int, seq_len: int, tp: int, *,
                               sequence_parallel: bool = False, regather: bool = True) -> dict:
    """Bytes autograd saves per rank during one forward + loss of the lab model in fp32 on CPU kernels
    (:mod:`labkit.theory.memory`, ``activation_model="lab"``, ``ParallelConfig(tp, sequence_parallel)``):
    ``{"per_layer", "total"}`` (total = layers + embedding/head/loss items).

    The memory model assumes SP stores the linear-layer inputs as sequence shards (the re-gather); with
    ``regather=False`` each column region (attention's wq/wk/wv and the MLP's input linears in every layer,
    and the output layer) stores the gathered input [B, T, H] instead of its shard [B, T/tp, H]: TP+SP plus
    B·T·H·bytes·(1 - 1/tp) per region (Korthikanti et al. 2022, Section 4.2.2: storing the shard is what the
    extra all-gather buys). Raises ValueError for an unknown model or bad sizes."""
    if isinstance(spec, str):
        spec = get_spec(spec)
    train = mem.TrainConfig(micro_batch_size=batch_size, seq_len=seq_len, convention="torch-fp32", kernels="cpu")
    par = mem.ParallelConfig(tp=tp, sequence_parallel=sequence_parallel)
    per_layer = mem.activation_bytes_per_layer(spec, train, par)
    total = spec.n_layers * per_layer + sum(i.nbytes for i in mem.edge_activation_items(spec, train, par))
    if sequence_parallel and not regather:
        e = train.act_bits() // 8
        gathered = batch_size * seq_len * spec.hidden_size * e * (tp - 1) // tp  # per column region
        per_layer += 2 * gathered
        total += (2 * spec.n_layers + 1) * gathered
    return {"per_layer": per_layer, "total": total}
