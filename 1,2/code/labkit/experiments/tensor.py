"""Tensor parallelism, measured: the rank functions that tests/test_tensor_parallel.py, chapter 05 and
benchmarks/tp_vs_dtensor.py share.

* :func:`tp_check_rank` — one launch checks everything: parity of every layer, block and whole model against
  the unsharded one built from the same full weights (hand TP and TP+SP, the DTensor variant), every
  collective of a training step counted (:func:`count_model_collectives`, :func:`count_mlp_pair_collectives`),
  the reproduced field cases (:func:`_field_cases`), saved-activation bytes (:func:`activation_bytes`);
* :func:`step_time_rank` — hand TP vs DTensor vs tp = 1 step times, interleaved step by step;
* :func:`comm_table`, :func:`comm_vs_theory` — counted collectives grouped like, and set beside, the
  predictions of :mod:`labkit.theory.tensor`.

The strategy is :mod:`labkit.parallel.tensor`; its formulas are :mod:`labkit.theory.tensor`.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit.checks import check_choice, positive_int
from labkit.models import TOLERANCES, SyntheticLM, build_model, lm_loss, make_optimizer
from labkit.parallel.tensor.blocks import ParallelAttention, ParallelMLP
from labkit.parallel.tensor.dtensor import _dtensor_backward, _full, apply_dtensor_tp, dtensor_loss
from labkit.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    _unchecked_vocab_parallel_ce,
    vocab_parallel_cross_entropy,
)
from labkit.parallel.tensor.model import apply_tp, finalize_grads, gather_full
from labkit.parallel.tensor.primitives import SEQ_DIM, _all_gather_dim, _all_reduce, tp_rank, tp_size
from labkit.runtime.commlog import CommLog
from labkit.theory.spec import ModelSpec, get_spec
from labkit.theory.tensor import check_tp, kv_plan, pad_vocab_size


# ------------------------------------------------------------------------------------------------------
# counted collectives beside the theory's rows
# ------------------------------------------------------------------------------------------------------
def comm_table(records) -> list[dict]:
    """Group CommLog records (``log.records`` or ``log.to_frame()`` rows) into rows like the theory's:
    ``where``, ``phase``, ``op``, ``calls``, ``nbytes`` (S per call; ``None`` when calls differ in size,
    with ``nbytes_list``), ``bytes_per_rank``; tags ``"where/phase"``."""
    groups: dict = {}
    for r in records:
        where, _, phase = r["tag"].partition("/")
        key = (where, phase or "bwd", r["op"])
        groups.setdefault(key, []).append(r)
    rows = []
    for (where, phase, op), rs in groups.items():
        sizes = [int(r["nbytes"]) for r in rs]
        row = {"where": where, "phase": phase, "op": op, "calls": len(rs),
               "nbytes": sizes[0] if len(set(sizes)) == 1 else None,
               "bytes_per_rank": float(sum(r["bytes_per_rank"] for r in rs))}
        if row["nbytes"] is None:
            row["nbytes_list"] = sorted(sizes)
        rows.append(row)
    return rows


def comm_vs_theory(records, theory: list[dict]) -> list[dict]:
    """Logged collectives (CommLog records: measured, what the code issued) beside predicted ones (theory
    rows), one row per (where, phase, op): ``calls_measured``, ``calls_predicted``, ``nbytes_measured``,
    ``nbytes_predicted`` (S per call, or the sorted list when calls differ), ``bytes_per_rank_model`` (the
    logged S x ring factor: a model of what a ring sends for those calls, not a measurement; what the sockets
    carried is in :func:`labkit.chapters.ch05_tensor_parallel.step_bytes_table`), ``bytes_per_rank_predicted``,
    ``match`` (calls and sizes equal)."""
    meas = {(r["where"], r["phase"], r["op"]): r for r in comm_table(records)}
    pred = {(r["where"], r["phase"], r["op"]): r for r in theory}

    def sizes(r):
        if r is None:
            return None
        return r["nbytes"] if r.get("nbytes") is not None else r.get("nbytes_list")

    order = list(pred) + [k for k in meas if k not in pred]
    rows = []
    for key in order:
        m, p = meas.get(key), pred.get(key)
        rows.append({"where": key[0], "phase": key[1], "op": key[2],
                     "calls_measured": m["calls"] if m else 0, "calls_predicted": p["calls"] if p else 0,
                     "nbytes_measured": sizes(m), "nbytes_predicted": sizes(p),
                     "bytes_per_rank_model": m["bytes_per_rank"] if m else 0.0,
                     "bytes_per_rank_predicted": p["bytes_per_rank"] if p else 0.0,
                     "match": m is not None and p is not None and m["calls"] == p["calls"] and sizes(m) == sizes(p)})
    return rows


# ------------------------------------------------------------------------------------------------------
# rank functions (launch(fn, world_size, ...))
# ------------------------------------------------------------------------------------------------------
def _perturb(model: nn.Module, seed: int = 1) -> nn.Module:
    """Give biases and norm weights non-trivial values (the same on every rank) so parity checks see them:
    the lab's init sets biases to 0 and norm weights to 1, which would hide a bias added tp times."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_((torch.randn(p.shape, generator=g) * 0.1).to(p.dtype))
    return model


def _compare(check: str, got, want, dtype=torch.float32, atol_extra: float = 0.0, **extra) -> dict:
    """One parity row: max abs error and pass/fail under TOLERANCES[dtype] (torch.testing.assert_close),
    ``atol_extra`` added to the absolute tolerance where a row states why."""
    tol = dict(TOLERANCES[dtype])
    tol["atol"] += atol_extra
    if isinstance(want, dict):
        pairs = [(k, got.get(k), v) for k, v in want.items()]
    else:
        pairs = [(check, got, want)]
    err, ok, msg = 0.0, True, ""
    for key, g, w in pairs:
        if g is None:
            ok, msg = False, f"{key}: missing"
            continue
        g, w = torch.as_tensor(g).detach().cpu().float(), torch.as_tensor(w).detach().cpu().float()
        if g.shape != w.shape:
            ok, msg = False, f"{key}: shape {tuple(g.shape)} != {tuple(w.shape)}"
            continue
        err = max(err, float((g - w).abs().max()) if g.numel() else 0.0)
        try:
            torch.testing.assert_close(g, w, **tol)
        except AssertionError as e:
            ok = False
            msg = msg or f"{key}: " + " ".join(str(e).split())[:300]
    return {"check": check, "max_abs_err": err, "rtol": tol["rtol"], "atol": tol["atol"], "ok": ok,
            "detail": msg, **extra}


def _seeded_linear(in_features: int, out_features: int, seed: int, device) -> nn.Linear:
    """An nn.Linear with the same weights and bias on every rank (nn.Linear's own init uses each rank's
    global RNG, which is exactly the sharding-dependent-init field case)."""
    lin = nn.Linear(in_features, out_features, device=device)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lin.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return lin


def _inputs(shape, seed: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device)


def _block_parity(ctx, name: str, full: nn.Module, par: nn.Module, x: torch.Tensor, sp: bool, group=None) -> list:
    """Forward + backward of a block against its unsharded original: output, input gradient, weight grads."""
    n, r = tp_size(group), tp_rank(group)
    xr = x.clone().requires_grad_(True)
    yr = full(xr)
    w = _inputs(yr.shape, 99, x.device)
    (yr * w).sum().backward()
    xl = (x.chunk(n, SEQ_DIM)[r] if sp else x).clone().requires_grad_(True)
    yl = par(xl)
    wl = w.chunk(n, SEQ_DIM)[r] if sp else w
    (yl * wl).sum().backward()
    finalize_grads(par, group)
    want_y = yr.chunk(n, SEQ_DIM)[r] if sp else yr
    want_dx = xr.grad.chunk(n, SEQ_DIM)[r] if sp else xr.grad
    grads = gather_full(par, "grad", group)
    ref = {k: p.grad for k, p in full.named_parameters()}
    extra = {"tp": n, "sp": sp}
    return [_compare(f"{name}: output", yl, want_y, **extra),
            _compare(f"{name}: input grad", xl.grad, want_dx, **extra),
            _compare(f"{name}: weight grads", grads, ref, **extra)]


def _gathered_logits(logits: torch.Tensor, vocab_size: int, group=None) -> torch.Tensor:
    return _all_gather_dim(logits.detach(), -1, group)[..., :vocab_size]


def _model_parity(ctx, spec: ModelSpec, sp: bool, batch_size: int, seq_len: int, steps: int, lr: float,
                  seed: int, group=None) -> list:
    """The whole model: logits, loss, every gradient (step 0), then losses and weights over ``steps``
    AdamW steps, TP vs the unsharded reference built from the same full weights."""
    n = tp_size(group)
    ref = _perturb(build_model(spec, seed, device=ctx.device))
    tpm = apply_tp(_perturb(build_model(spec, seed, device=ctx.device)), group, sequence_parallel=sp, pad_vocab=True)
    data = SyntheticLM(spec.vocab_size, seq_len, seed)
    o_ref, o_tp = make_optimizer(ref.parameters(), lr), make_optimizer(tpm.parameters(), lr)
    label = f"model {spec.name}" + (f" (vocab {spec.vocab_size}, padded to {tpm.padded_vocab_size})"
                                    if tpm.padded_vocab_size != spec.vocab_size else "")
    extra = {"tp": n, "sp": sp}
    rows, l_ref, l_tp = [], [], []
    for step in range(steps):
        tokens, targets = (t.to(ctx.device) for t in data.batch(step, batch_size))
        o_ref.zero_grad(set_to_none=True)
        o_tp.zero_grad(set_to_none=True)
        logits_r = ref(tokens)
        loss_r = lm_loss(logits_r, targets)
        loss_r.backward()
        logits_t = tpm(tokens)
        loss_t = tpm.loss(logits_t, targets)
        loss_t.backward()
        finalize_grads(tpm, group)
        if step == 0:
            rows.append(_compare(f"{label}: logits", _gathered_logits(logits_t, spec.vocab_size, group), logits_r,
                                 **extra))
            rows.append(_compare(f"{label}: grads", gather_full(tpm, "grad", group),
                                 {k: p.grad for k, p in ref.named_parameters()}, **extra))
        l_ref.append(loss_r.item())
        l_tp.append(loss_t.item())
        o_ref.step()
        o_tp.step()
    rows.append(_compare(f"{label}: losses over {steps} AdamW steps", torch.tensor(l_tp), torch.tensor(l_ref),
                         **extra))
    # Adam divides each gradient by its running RMS: where a gradient is near eps=1e-8, a rounding-level
    # difference moves that element's update by up to lr, so weights get atol = 0.1 * lr * steps on top of
    # fp32's (a parameter left un-updated would still be off by ~lr per step).
    rows.append(_compare(f"{label}: weights after {steps} steps", gather_full(tpm, "param", group),
                         {k: p.detach() for k, p in ref.named_parameters()}, atol_extra=0.1 * lr * steps,
                         **extra))
    return rows


def _loss_parity(ctx, vocab_size: int, tokens: int, group=None) -> list:
    """The vocab-parallel loss alone (with padding when tp does not divide vocab_size): loss and logit grads."""
    n, r = tp_size(group), tp_rank(group)
    vp = pad_vocab_size(vocab_size, n)
    full = _inputs((tokens, vocab_size), 5, ctx.device) * 3
    targets = torch.randint(vocab_size, (tokens,), generator=torch.Generator().manual_seed(6)).to(ctx.device)
    fr = full.clone().requires_grad_(True)
    want = F.cross_entropy(fr, targets)
    want.backward()
    padded = torch.cat([full, torch.zeros(tokens, vp - vocab_size, device=ctx.device)], -1)
    local = padded.chunk(n, -1)[r].clone().requires_grad_(True)
    got = vocab_parallel_cross_entropy(local, targets, vocab_size, group)
    got.backward()
    want_g = torch.cat([fr.grad, torch.zeros(tokens, vp - vocab_size, device=ctx.device)], -1).chunk(n, -1)[r]
    label = f"vocab-parallel loss (V={vocab_size}, padded to {vp})"
    return [_compare(f"{label}: loss", got, want, tp=n, sp=False),
            _compare(f"{label}: logit grads", local.grad, want_g, tp=n, sp=False)]


def init_gap_vs_tp1(in_features: int, out_features: int, vocab_size: int, seed: int, group=None) -> dict:
    """How far the lab's own initialisation depends on tp: for :class:`ColumnParallelLinear` [out, in],
    :class:`RowParallelLinear` [in, out] and :class:`VocabParallelEmbedding` [vocab, in], each built from
    ``seed`` on ``group`` and its shards all-gathered, max |gathered full weight - the same layer built at tp=1|
    (on a group of this rank alone: every rank creates the one-rank groups, so call it on every rank).
    0.0 per layer when the full weight is the same at every tp (the layers draw the full master matrix and
    keep their block); a layer that seeds its own shard differs. Returns ``{"column", "row",
    "vocab embedding"}`` -> float."""
    alone = dist.new_subgroups(group_size=1)[0]  # tp=1: this rank alone
    vp = pad_vocab_size(vocab_size, tp_size(group))
    makers = {
        "column": (lambda g: ColumnParallelLinear(in_features, out_features, bias=False, group=g, seed=seed), 0),
        "row": (lambda g: RowParallelLinear(out_features, in_features, bias=False, group=g, seed=seed), 1),
        "vocab embedding": (lambda g: VocabParallelEmbedding(vocab_size, in_features, group=g, seed=seed,
                                                             padded_vocab_size=vp if g is group else None), 0),
    }
    gaps = {}
    for name, (make, dim) in makers.items():
        with torch.no_grad():
            full_tp = _all_gather_dim(make(group).weight.detach(), dim, group)
            full_1 = make(alone).weight.detach()
        if name == "vocab embedding":
            full_tp = full_tp[:vocab_size]  # padding rows past the vocabulary are zero at every tp
        gaps[name] = (float((full_tp - full_1).abs().max()) if full_tp.shape == full_1.shape
                      else float("inf"))
    return gaps


def _field_cases(ctx, spec: ModelSpec, batch_size: int, seq_len: int, seed: int, group=None) -> list[dict]:
    """Reproduce the field cases and show what catches them. Each row: ``case``, ``what``, ``value``,
    ``caught`` (computed, never assumed: True when the check here flags the reproduced bug and passes the
    lab's code: case 1 the reference output, case 2 the same layers built at tp=1, case 3 the layout check's
    ValueError)."""
    n = tp_size(group)
    rows = []
    tol = TOLERANCES[torch.float32]
    # 1. Colwise -> GELU(tanh) -> Rowwise whose output differs: the row bias added on every rank, before g.
    full = _perturb(build_model(spec, seed, device=ctx.device)).layers[0].mlp
    x = _inputs((batch_size, seq_len, spec.hidden_size), 7, ctx.device)
    with torch.no_grad():
        want = full(x)
        par = ParallelMLP(full, group)
        good = par(x)
        h = F.gelu(F.linear(x, par.fc_in.weight, par.fc_in.bias), approximate="tanh")
        bad = _all_reduce(F.linear(h, par.fc_out.weight, par.fc_out.bias), group)
    rows.append({"case": "MLP: row bias added on every rank before the all-reduce",
                 "what": "max |out - reference|: bias-before-reduce vs RowParallelLinear",
                 "value": float((bad - want).abs().max()), "ours": float((good - want).abs().max()),
                 "caught": not torch.allclose(bad, want, **tol) and torch.allclose(good, want, **tol)})
    # 2. initialisation that depends on sharding: every rank draws its own shard with the same seed
    out_f, in_f = spec.ffn_hidden_size, spec.hidden_size
    torch.manual_seed(seed)
    own = nn.Linear(in_f, out_f // n, bias=False).weight.detach()
    per_shard = _all_gather_dim(own.unsqueeze(0), 0, group).reshape(out_f, in_f)
    torch.manual_seed(seed)
    tp1 = nn.Linear(in_f, out_f, bias=False).weight.detach()
    # ours: the lab's layers initialised at this tp and gathered, against the same layers built at tp=1 (a group
    # of this rank alone): what the claim "the full function does not depend on tp" says, checked on the layers
    gaps = init_gap_vs_tp1(in_f, out_f, spec.vocab_size, seed, group)
    ours = max(gaps.values())
    value = float((per_shard - tp1).abs().max()) if n > 1 else 0.0
    rows.append({"case": "initialisation per shard (every rank seeds its own shard)",
                 "what": "max |full weight at tp - full weight at tp=1|: per-shard nn.Linear init vs the lab's "
                         "layers (column, row, vocab embedding) built at tp=1",
                 "value": value, "ours": ours, "ours_by_layer": gaps,
                 "caught": value > tol["atol"] and ours == 0.0})
    # 3. a row-parallel output layer feeding a vocab-parallel loss
    model = _perturb(build_model(spec.replace(tied_embeddings=False), seed, device=ctx.device))
    tokens, targets = (t.to(ctx.device) for t in SyntheticLM(spec.vocab_size, seq_len, seed).batch(0, batch_size))
    with torch.no_grad():
        hidden = model.norm(model.embed_tokens(tokens))  # the layers do not matter for this case
        want_loss = float(lm_loss(model.lm_head(hidden), targets))
        row_head = RowParallelLinear.from_linear(model.lm_head, group, input_is_parallel=False)
        logits = row_head(hidden)
        silent = float(_unchecked_vocab_parallel_ce(logits.clone(), targets, group))
        try:
            vocab_parallel_cross_entropy(logits, targets, spec.vocab_size, group)
            err = None
        except ValueError as e:
            err = str(e)
        try:
            vocab_parallel_cross_entropy(logits.clone(), targets, spec.vocab_size, group)  # layout tag lost
            err2 = None
        except ValueError as e:
            err2 = str(e)
    rows.append({"case": "row-parallel output layer -> vocab-parallel loss",
                 "what": f"shape-trusting loss {silent:.4f} vs reference {want_loss:.4f} (no error)",
                 "value": abs(silent - want_loss), "ours": err, "ours_untagged": err2,
                 "caught": err is not None and err2 is not None})
    return rows


def count_model_collectives(ctx, spec: ModelSpec, batch_size: int, seq_len: int, *, sequence_parallel: bool,
                            regather: bool = True, seed: int = 0, label: str = "TP", group=None,
                            socket: dict | None = None) -> list[dict]:
    """Every collective of one TP training step (forward, loss, backward, finalize), as CommLog records
    (``op``, ``nbytes``, ``bytes_per_rank``, ``tag``=``where/phase``...). Also adds them, and the
    ``{label} forward`` / ``{label} backward`` spans, to ``ctx.timeline``. With ``socket`` (a dict), stores
    ``socket["bytes"]``: the bytes this process wrote during the step, measured
    (:func:`labkit.runtime.probes.socket_bytes_written`; gloo's socket sends, None on CUDA or without
    /proc/self/io)."""
    from labkit.runtime.probes import socket_bytes_written

    tpm = apply_tp(build_model(spec, seed, device=ctx.device), group, sequence_parallel=sequence_parallel,
                   pad_vocab=True, regather=regather)
    tokens, targets = (t.to(ctx.device) for t in SyntheticLM(spec.vocab_size, seq_len, seed).batch(0, batch_size))
    ctx.barrier()
    before = None if ctx.device.type == "cuda" else socket_bytes_written()
    with CommLog(ctx) as log:
        tpm.commlog = log
        with ctx.timer(f"{label} forward", barrier=True):
            logits = tpm(tokens)
            loss = tpm.loss(logits, targets)
        with ctx.timer(f"{label} backward"):
            loss.backward()
        tpm.end_tags()
        with log.tagged("finalize/bwd"):
            finalize_grads(tpm, group)
    after = socket_bytes_written() if before is not None else None
    if socket is not None:
        socket["bytes"] = None if after is None else after - before
    tpm.commlog = None
    return [{k: v for k, v in r.items() if k not in ("start_ns", "end_ns")} for r in log.records]


def count_mlp_pair_collectives(ctx, kind: str, tokens: int, hidden_size: int, ffn_hidden_size: int,
                               group=None) -> list[dict]:
    """Collectives of a GELU MLP built as column->row or column->column (see
    :func:`labkit.theory.tensor.comm_theory_mlp_pair`), forward + backward, checked against the unsharded MLP
    (records plus a ``parity_ok`` flag on each). Raises ValueError for an unknown kind."""
    check_choice("kind", kind, ("column-row", "column-column"))
    dev = torch.device("cpu") if ctx is None else ctx.device
    l1 = _seeded_linear(hidden_size, ffn_hidden_size, 3, dev)
    l2 = _seeded_linear(ffn_hidden_size, hidden_size, 4, dev)
    x = _inputs((tokens, hidden_size), 4, dev).requires_grad_(True)
    want = l2(F.gelu(l1(x), approximate="tanh"))
    c1 = ColumnParallelLinear.from_linear(l1, group, gather_output=kind == "column-column")
    c2 = (RowParallelLinear.from_linear(l2, group) if kind == "column-row"
          else ColumnParallelLinear.from_linear(l2, group, gather_output=True))
    with CommLog(ctx) as log:
        with log.tagged(f"{kind}/fwd"):
            y = c2(F.gelu(c1(x), approximate="tanh"))
        with log.tagged(f"{kind}/bwd"):
            y.sum().backward()
    ok = torch.allclose(y.detach(), want.detach(), **TOLERANCES[torch.float32])
    return [{**{k: v for k, v in r.items() if k not in ("start_ns", "end_ns")}, "parity_ok": ok} for r in log.records]


def activation_bytes(ctx, spec: ModelSpec, batch_size: int, seq_len: int, seed: int = 0, group=None) -> list[dict]:
    """Bytes autograd saves for the backward during one forward + loss, per rank, measured with
    :class:`labkit.runtime.measure.SavedActivations` (saved-tensor hooks, each storage once, parameters excluded): the
    unsharded model (tp=1), TP, TP+SP with the re-gather, TP+SP storing the gathered linear inputs.
    Rows: ``variant``, ``tp``, ``bytes`` (total), ``per_layer`` (bytes first saved inside each layer),
    ``outside_layers`` (embedding, final norm, head, loss).

    Prediction to set beside it (Korthikanti et al. 2022, Table 2): per layer sbh(34 + 5as/h) unsharded,
    sbh(10 + 24/t + 5as/ht) with TP (the norms, residuals and linear-layer inputs stay whole), sbh(34/t +
    5as/ht) with TP+SP: everything 1/t, so TP+SP ~= (tp=1 bytes) / tp."""
    n = tp_size(group)
    tokens, targets = (t.to(ctx.device) for t in SyntheticLM(spec.vocab_size, seq_len, seed).batch(0, batch_size))
    from labkit.runtime.measure import SavedActivations

    def row(variant, tp_degree, acts):
        return {"variant": variant, "tp": tp_degree, "bytes": acts.total_bytes, "per_layer": acts.per_layer,
                "outside_layers": acts.total_bytes - sum(acts.per_layer)}

    ref = build_model(spec, seed, device=ctx.device)
    with SavedActivations(ref, keep_items=False) as acts:
        loss = lm_loss(ref(tokens), targets)
    rows = [row("tp=1 (unsharded)", 1, acts)]
    del loss
    for label, sp, regather in (("TP", False, True), ("TP+SP", True, True), ("TP+SP, no re-gather", True, False)):
        tpm = apply_tp(build_model(spec, seed, device=ctx.device), group, sequence_parallel=sp, pad_vocab=True,
                       regather=regather)
        with SavedActivations(tpm, keep_items=False) as acts:
            loss = tpm.loss(tpm(tokens), targets)
        rows.append(row(label, n, acts))
        del loss, tpm
    return rows



def dtensor_parity_spec(spec: ModelSpec, tp: int) -> ModelSpec:
    """The model the DTensor parity check runs: ``spec`` itself, or, when tp does not divide its kv heads
    (DTensor's ColwiseParallel cannot replicate them), the same model with n_kv_heads = tp."""
    return spec.replace(n_kv_heads=tp, name=f"{spec.name}, n_kv_heads={tp}") if spec.n_kv_heads % tp else spec


def _dtensor_parity(ctx, spec: ModelSpec, sp: bool, batch_size: int, seq_len: int, seed: int) -> list:
    n = dist.get_world_size()
    spec = dtensor_parity_spec(spec, n)
    ref = _perturb(build_model(spec, seed, device=ctx.device))
    m = apply_dtensor_tp(_perturb(build_model(spec, seed, device=ctx.device)), sequence_parallel=sp)
    tokens, targets = (t.to(ctx.device) for t in SyntheticLM(spec.vocab_size, seq_len, seed).batch(0, batch_size))
    logits_r = ref(tokens)
    lm_loss(logits_r, targets).backward()
    logits = m(tokens)
    loss = dtensor_loss(logits, targets)
    _dtensor_backward(loss)
    grads = {k: _full(p.grad) for k, p in m.named_parameters()}
    extra = {"tp": n, "sp": sp}
    return [_compare(f"DTensor {spec.name}: logits", _full(logits), logits_r, **extra),
            _compare(f"DTensor {spec.name}: loss", _full(loss), lm_loss(logits_r.detach(), targets), **extra),
            _compare(f"DTensor {spec.name}: grads", grads, {k: p.grad for k, p in ref.named_parameters()}, **extra)]


#: the training steps whose collectives tp_check_rank counts: (key, label, sequence_parallel, regather)
COMM_RUNS = (("tp", "TP", False, True), ("sp", "TP+SP", True, True), ("sp_no_regather", "TP+SP (no re-gather)", True,
                                                                       False))



def tp_check_rank(ctx, spec_name: str = "lab-tiny-llama", gelu_spec_name: str = "lab-tiny-gpt", *,
                  batch_size: int = 2, seq_len: int = 16, steps: int = 2, lr: float = 1e-3, seed: int = 0,
                  dtensor=True, activations: bool = True) -> dict:
    """Everything chapter 05 and tests/test_tensor_parallel.py check, in one launch (tp = world size):

    * ``parity``: rows (check, tp, sp, max_abs_err, rtol, atol, ok, detail) — column and row linear, GELU(tanh)
      MLP and SwiGLU MLP, GQA attention (kv heads split or replicated), each with and without SP; the whole
      model (Llama-style with a padded vocabulary, GPT-style with tied embeddings, each TP and TP+SP): logits,
      loss, every gradient, losses and weights over ``steps`` AdamW steps; the vocab-parallel loss with
      padding; the DTensor variant (TP and TP+SP). When ``spec_name == gelu_spec_name`` a case that would
      repeat another (same model, same SP flag) runs once. fp32, tolerances from ``labkit.models.TOLERANCES``.
    * ``comm``: {"tp": records, "sp": records, "sp_no_regather": records} of one training step of
      ``spec_name`` (CommLog, tagged ``where/phase``), to compare with
      :func:`labkit.theory.tensor.comm_theory_model`; ``socket_bytes``: {same keys: bytes this rank wrote to
      gloo's sockets during that step (measured), or None};
      :func:`labkit.chapters.ch05_tensor_parallel.step_bytes_table` puts them side by side;
    * ``comm_pair``: records of column->row and column->column MLPs;
    * ``field``: the reproduced field cases (:func:`_field_cases`);
    * ``activations``: saved-activation bytes per rank (:func:`activation_bytes`).
    ``dtensor``: True runs the DTensor parity check without and with SP, False skips it, or a tuple of SP
    flags to run (:func:`labkit.chapters.ch05_tensor_parallel.check_chapter` decides which the model
    allows).
    All ranks return the same (rank 0's numbers suffice). Raises ValueError for world_size < 2 or bad sizes,
    or a DTensor check the model does not allow (before any work).
    """
    spec, gspec = get_spec(spec_name), get_spec(gelu_spec_name)
    n = positive_int("world_size", ctx.world_size, minimum=2)  # tp=1 has nothing to split
    for s in (spec, gspec):
        check_tp(s, n, pad_vocab=True, sequence_parallel=True, seq_len=seq_len)
    dtensor_sp = (False, True) if dtensor is True else (() if dtensor is False else tuple(dtensor))
    for sp in dtensor_sp:
        check_tp(dtensor_parity_spec(spec, n), n, sequence_parallel=sp, seq_len=seq_len, dtensor=True)
    t0 = time.perf_counter()
    out: dict = {"tp": n, "spec": spec_name, "gelu_spec": gelu_spec_name, "batch_size": batch_size,
                 "seq_len": seq_len}
    parity = []
    dev = ctx.device
    h = spec.hidden_size
    sections: dict[str, float] = {}
    last = [time.perf_counter()]

    def lap(name: str) -> None:
        now = time.perf_counter()
        sections[name] = now - last[0]
        last[0] = now

    # one linear layer, split by columns and by rows
    lin = _seeded_linear(h, 2 * h, 21, dev)
    x = _inputs((batch_size, seq_len, h), 11, dev)
    parity += _block_parity(ctx, "linear, column-parallel (gathered output)", lin,
                            ColumnParallelLinear.from_linear(lin, gather_output=True), x, False)
    lin2 = _seeded_linear(2 * h, h, 22, dev)
    x2 = _inputs((batch_size, seq_len, 2 * h), 12, dev)
    parity += _block_parity(ctx, "linear, row-parallel (scattered input)", lin2,
                            RowParallelLinear.from_linear(lin2, input_is_parallel=False), x2, False)
    for sp in (False, True):
        gfull = _perturb(build_model(gspec, seed, device=dev)).layers[0].mlp
        parity += _block_parity(ctx, "MLP column -> GELU(tanh) -> row", gfull,
                                ParallelMLP(copy_module(gfull), sequence_parallel=sp), x, sp)
        if spec != gspec:  # the same model twice (model == gelu_model) would repeat the GELU rows
            sfull = _perturb(build_model(spec, seed, device=dev)).layers[0].mlp
            label = "MLP SwiGLU" if spec.mlp == "swiglu" else f"MLP {spec.mlp} ({spec_name})"
            parity += _block_parity(ctx, label, sfull, ParallelMLP(copy_module(sfull), sequence_parallel=sp), x, sp)
        afull = _perturb(build_model(spec, seed, device=dev)).layers[0].attn
        plan = kv_plan(spec.n_heads, spec.n_kv_heads, n)
        parity += _block_parity(ctx, f"attention GQA ({spec.n_heads} q / {spec.n_kv_heads} kv heads, kv {plan})",
                                afull, ParallelAttention(copy_module(afull), spec.n_heads, spec.n_kv_heads,
                                                         sequence_parallel=sp), x, sp)
    lap("linear, MLP, attention")
    parity += _loss_parity(ctx, 255, batch_size * seq_len)
    padded_spec = spec.replace(vocab_size=spec.vocab_size - 3)
    model_cases: list = []
    for case in ((spec, False), (padded_spec, True), (gspec, False), (gspec, True)):
        if case not in model_cases:  # model == gelu_model: its TP case runs once
            model_cases.append(case)
    for s, sp in model_cases:
        parity += _model_parity(ctx, s, sp, batch_size, seq_len, steps, lr, seed)
    lap("loss, whole models")
    for sp in dtensor_sp:
        parity += _dtensor_parity(ctx, spec, sp, batch_size, seq_len, seed)
    lap("DTensor")
    out["parity"] = parity
    out["comm"], out["socket_bytes"] = {}, {}
    for key, label, sp, regather in COMM_RUNS:
        sock: dict = {}
        out["comm"][key] = count_model_collectives(ctx, spec, batch_size, seq_len, sequence_parallel=sp,
                                                   regather=regather, seed=seed, label=label, socket=sock)
        out["socket_bytes"][key] = sock["bytes"]
    out["comm_pair"] = (count_mlp_pair_collectives(ctx, "column-row", batch_size * seq_len, h, spec.ffn_hidden_size)
                        + count_mlp_pair_collectives(ctx, "column-column", batch_size * seq_len, h,
                                                     spec.ffn_hidden_size))
    lap("counted collectives")
    out["field"] = _field_cases(ctx, gspec, batch_size, seq_len, seed)
    lap("field cases")
    if activations:
        out["activations"] = activation_bytes(ctx, spec, batch_size, seq_len, seed)
    lap("activation bytes")
    out["section_s"] = sections
    out["seconds"] = time.perf_counter() - t0
    return out


def copy_module(m: nn.Module) -> nn.Module:
    """A deep copy (the TP wrappers reuse and replace submodules; keep the reference intact)."""
    import copy

    return copy.deepcopy(m)


STEP_VARIANTS = ("tp1", "hand", "hand_sp", "dtensor", "dtensor_sp")


def check_step_variants(spec: ModelSpec, tp: int, variants, seq_len: int) -> None:
    """Raise ValueError for a variant not in :data:`STEP_VARIANTS` or one ``spec`` cannot run at ``tp``
    (:func:`labkit.theory.tensor.check_tp`: hand variants pad the vocabulary, DTensor ones do not)."""
    for v in variants:
        check_choice("variant", v, STEP_VARIANTS)
        if v != "tp1":
            check_tp(spec, tp, sequence_parallel=v.endswith("_sp"), seq_len=seq_len, dtensor=v.startswith("dtensor"),
                     pad_vocab=v.startswith("hand"))


def step_time_rank(ctx, spec_name: str = "lab-tiny-llama", variants=("tp1", "hand", "dtensor"), *,
                   batch_size: int = 4, seq_len: int = 64, steps: int = 5, warmup: int = 2, lr: float = 1e-3,
                   seed: int = 0) -> dict:
    """Measured training-step time (forward, loss, backward, finalize, AdamW) of several variants of the same
    model in the same run, interleaved step by step so machine load hits them alike.

    Variants: ``tp1`` (the unsharded model on rank 0 alone; the other ranks wait), ``hand`` / ``hand_sp``
    (:func:`apply_tp`, without / with sequence parallelism), ``dtensor`` / ``dtensor_sp``
    (:func:`apply_dtensor_tp`). Every step starts after a barrier and ends after one (the step is done when
    the slowest rank is). Returns ``{"step_s": {variant: [seconds per measured step]}, "losses": {variant:
    [...]}, "tp", "spec", ...}``; the timeline gets a ``{variant} step`` span per step.
    Raises ValueError for an unknown variant or a spec the variant cannot run (before any step).
    """
    spec = get_spec(spec_name)
    n = ctx.world_size
    check_step_variants(spec, n, variants, seq_len)
    steps, warmup = positive_int("steps", steps), positive_int("warmup", warmup, minimum=0)
    data = SyntheticLM(spec.vocab_size, seq_len, seed)
    models = {}
    for v in variants:
        if v == "tp1":
            m = build_model(spec, seed, device=ctx.device) if ctx.rank == 0 else None
        elif v.startswith("hand"):
            m = apply_tp(build_model(spec, seed, device=ctx.device), sequence_parallel=v == "hand_sp", pad_vocab=True)
        else:
            m = apply_dtensor_tp(build_model(spec, seed, device=ctx.device), sequence_parallel=v == "dtensor_sp")
        models[v] = (m, make_optimizer(m.parameters(), lr) if m is not None else None)
    times: dict = {v: [] for v in variants}
    losses: dict = {v: [] for v in variants}
    for step in range(warmup + steps):
        tokens, targets = (t.to(ctx.device) for t in data.batch(step, batch_size))
        for v in variants:
            m, opt = models[v]
            ctx.barrier()
            t0 = time.perf_counter()
            with ctx.timeline.span(f"{v} step", "compute", step=step):
                if m is not None:
                    opt.zero_grad(set_to_none=True)
                    if v == "tp1":
                        loss = lm_loss(m(tokens), targets)
                        loss.backward()
                    elif v.startswith("hand"):
                        loss = m.loss(m(tokens), targets)
                        loss.backward()
                        finalize_grads(m)
                    else:
                        loss = dtensor_loss(m(tokens), targets)
                        _dtensor_backward(loss)
                    opt.step()
                    losses[v].append(float(_full(loss)))
                ctx.barrier()
            if step >= warmup:
                times[v].append(time.perf_counter() - t0)
    return {"step_s": times, "losses": losses, "tp": n, "spec": spec_name, "batch_size": batch_size,
            "seq_len": seq_len, "steps": steps, "warmup": warmup, "threads": torch.get_num_threads()}

