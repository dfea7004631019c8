"""Chapter 05 (notebooks/05_tensor_parallel.ipynb): tensor and sequence parallelism.

The chapter's parameter check (:func:`check_chapter`, before any launch), its one launch
(:func:`chapter_rank`), the tables it sets measured beside predicted (:func:`step_bytes_table`,
:func:`activation_vs_theory`) and the sentences it prints from the numbers (:func:`step_time_findings`).
The strategy is :mod:`labkit.parallel.tensor`, its formulas :mod:`labkit.theory.tensor`, the rank functions
:mod:`labkit.experiments.tensor`.
"""

from __future__ import annotations

from labkit.chapters.common import check_fits_in_memory, check_world_size
from labkit.checks import positive_float, positive_int
from labkit.experiments.tensor import (
    COMM_RUNS,
    check_step_variants,
    dtensor_parity_spec,
    step_time_rank,
    tp_check_rank,
)
from labkit.theory.spec import ModelSpec, get_spec
from labkit.theory.tensor import activation_bytes_predicted, check_tp, step_ring_bytes


def check_chapter(*, world_size, model: str = "lab-tiny-llama", gelu_model: str = "lab-tiny-gpt", batch_size=2,
                  seq_len=16, train_steps=2, time_batch_size=4, time_seq_len=64, time_steps=3,
                  timeout_s=300.0) -> dict:
    """Chapter 05's parameters, all checked before any launch, and which variants this model allows.

    Checks (ValueError naming the value and the fix): world_size >= 2 (tp = world_size; tp=1 splits nothing);
    known, dense, CPU-sized models; ``gelu_model`` a GELU MLP with biases (the field cases need a row bias);
    :func:`labkit.theory.tensor.check_tp` for both models at tp (heads, kv heads split or replicated, ffn,
    vocabulary padded, SP with ``seq_len`` and ``time_seq_len``); sequence lengths within ``max_seq_len``;
    positive sizes, steps and ``timeout_s``.

    DTensor limits are decided here, not discovered in the ranks: the DTensor variant (``apply_dtensor_tp``)
    cannot replicate kv heads (tp must divide n_kv_heads; the parity check then uses a model with
    n_kv_heads = tp, :func:`~labkit.experiments.tensor.dtensor_parity_spec`), cannot hold tied embeddings,
    does not pad the vocabulary, and with SP runs RoPE models only (learned positions). Each DTensor variant
    the model cannot run is skipped, with the reason.

    Returns ``{"world_size", "dtensor_parity": SP flags to check (for ``tp_check_rank(dtensor=...)``),
    "time_variants": (...), "skipped": {variant: reason}}``.
    """
    n = check_world_size("05", world_size, why="tensor parallelism splits each layer over world_size "
                                 "ranks, and tp=1 splits nothing")
    spec, gspec = get_spec(model), get_spec(gelu_model)
    for s in (spec, gspec):
        if s.is_moe:
            raise ValueError(f"model {s.name!r} is a mixture-of-experts model; chapter 05 splits dense layers "
                             "(expert parallelism is chapter 08): use lab-tiny-llama or lab-tiny-gpt")
    if gspec.mlp != "gelu" or not gspec.bias:
        raise ValueError(f"gelu_model={gelu_model!r} must be a GELU model with biases (the field cases add a row "
                         "bias on every rank); use gelu_model='lab-tiny-gpt'")
    batch_size, time_batch_size = positive_int("batch_size", batch_size), positive_int("time_batch_size",
                                                                                         time_batch_size)
    positive_int("train_steps", train_steps)
    positive_int("time_steps", time_steps)
    positive_float("timeout_s", timeout_s)
    for name, t in (("seq_len", seq_len), ("time_seq_len", time_seq_len)):
        for s in (spec, gspec):
            s.check_seq_len(t, name)
    try:
        for s in (spec, gspec):
            check_tp(s, n, pad_vocab=True, sequence_parallel=True, seq_len=seq_len)
        check_tp(spec, n, pad_vocab=True, sequence_parallel=True, seq_len=time_seq_len)
    except ValueError as e:
        raise ValueError(f"world_size={n} is the tp degree in chapter 05: {e}") from None
    check_fits_in_memory(spec, n, copies=4, what="chapter 05")
    skipped: dict[str, str] = {}
    parity = []
    for sp in (False, True):
        label = "DTensor parity, TP+SP" if sp else "DTensor parity, TP"
        try:
            check_tp(dtensor_parity_spec(spec, n), n, sequence_parallel=sp, seq_len=seq_len, dtensor=True)
            parity.append(sp)
        except ValueError as e:
            skipped[label] = str(e)
    time_variants = ["tp1", "hand", "hand_sp"]
    try:
        check_tp(spec, n, seq_len=time_seq_len, dtensor=True)
        time_variants.append("dtensor")
    except ValueError as e:
        skipped["DTensor step time"] = str(e)
    return {"world_size": n, "dtensor_parity": tuple(parity), "time_variants": tuple(time_variants),
            "skipped": skipped}


def chapter_rank(ctx, spec_name: str = "lab-tiny-llama", gelu_spec_name: str = "lab-tiny-gpt", *,
                 batch_size: int = 2, seq_len: int = 16, steps: int = 2, time_variants=("tp1", "hand", "hand_sp"),
                 time_batch_size: int = 4, time_seq_len: int = 64, time_steps: int = 3, seed: int = 0,
                 dtensor_parity=(False, True)) -> dict:
    """Chapter 05 in one launch (a launch costs seconds on a 2-core machine): ``{"check":``
    :func:`~labkit.experiments.tensor.tp_check_rank` ``, "timed":``
    :func:`~labkit.experiments.tensor.step_time_rank` ``}``. ``dtensor_parity`` and
    ``time_variants`` come from :func:`check_chapter`. Raises ValueError (before any work) for a variant the
    model cannot run."""
    check_step_variants(get_spec(spec_name), ctx.world_size, time_variants, time_seq_len)
    check = tp_check_rank(ctx, spec_name, gelu_spec_name, batch_size=batch_size, seq_len=seq_len, steps=steps,
                          seed=seed, dtensor=dtensor_parity)
    timed = step_time_rank(ctx, spec_name, time_variants, batch_size=time_batch_size, seq_len=time_seq_len,
                           steps=time_steps, warmup=1, seed=seed)
    return {"check": check, "timed": timed}


def step_time_findings(step_s: dict, tp: int, *, near: float = 0.1) -> str:
    """What chapter 05's step-time run showed, as sentences computed from it (nothing assumed).

    ``step_s``: ``{variant: [seconds per measured step]}`` from
    :func:`~labkit.experiments.tensor.step_time_rank` with a ``"tp1"`` entry; ``tp``: the degree the other
    variants ran at. Compares each variant's median step time with tp = 1's:
    speedup = median(tp1) / median(variant). Within ``near`` (10 %) of 1 it says "about as fast"; below, that
    on this run the collectives cost more than the arithmetic TP split; above, that the split arithmetic
    outweighed them. Raises ValueError when ``step_s`` has no ``"tp1"`` entry, a variant has no times, or
    ``tp`` < 2."""
    tp = positive_int("tp", tp, minimum=2)
    if "tp1" not in step_s:
        raise ValueError(f"step_s has variants {sorted(step_s)}; expected a 'tp1' entry to compare against")
    empty = [v for v, t in step_s.items() if not len(t)]
    if empty:
        raise ValueError(f"step_s has no measured steps for {empty}; every variant needs at least one")

    def median(t):
        return sorted(t)[len(t) // 2]

    base = median(step_s["tp1"])
    parts, slower, faster = [], [], []
    for v, t in step_s.items():
        if v == "tp1":
            continue
        speedup = base / median(t)
        parts.append(f"{v} {median(t) * 1e3:.1f} ms ({speedup:.2f}x)")
        (slower if speedup < 1 - near else faster if speedup > 1 + near else []).append(v)
    text = (f"Measured median step time: tp1 {base * 1e3:.1f} ms; at tp={tp}: " + ", ".join(parts)
            + " (speedup vs tp1 in brackets).")
    if slower:
        text += (f" {', '.join(slower)} ran slower than one rank: in this run the collectives TP adds to every "
                 "layer cost more than the arithmetic it split.")
    if faster:
        text += f" {', '.join(faster)} ran faster than one rank: the split arithmetic outweighed the collectives."
    about = [v for v in step_s if v != "tp1" and v not in slower and v not in faster]
    if about:
        text += f" {', '.join(about)} ran about as fast as one rank (within {near:.0%})."
    return text


def step_bytes_table(check: dict) -> list[dict]:
    """Bytes one rank sends in one training step of each :data:`~labkit.experiments.tensor.COMM_RUNS` variant,
    from a :func:`~labkit.experiments.tensor.tp_check_rank` result, each number labelled with its source:
    ``payload S (measured: what the code issued)`` (CommLog), ``ring bytes (model: S x factor)``, ``ring bytes
    (predicted: comm_theory_model)`` (:func:`labkit.theory.tensor.step_ring_bytes`), ``gloo model`` (S x the
    factors of gloo's CPU algorithms: :data:`labkit.experiments.common.GLOO_FACTORS`), ``socket bytes written
    (measured: gloo)`` (NaN where not measurable) and ``measured / gloo model``."""
    from labkit.experiments.common import GLOO_FACTORS

    spec = get_spec(check["spec"])
    rows = []
    for key, label, sp, regather in COMM_RUNS:
        recs = check["comm"][key]
        predicted = step_ring_bytes(spec, check["batch_size"], check["seq_len"], check["tp"], sequence_parallel=sp,
                                    regather=regather)
        gloo = sum(r["nbytes"] * GLOO_FACTORS[r["op"]](r["group_size"]) for r in recs)
        sock = check.get("socket_bytes", {}).get(key)
        sock = float("nan") if sock is None else float(sock)
        rows.append({"variant": label, "payload S (measured: what the code issued)": sum(r["nbytes"] for r in recs),
                     "ring bytes (model: S x factor)": sum(r["bytes_per_rank"] for r in recs),
                     "ring bytes (predicted: comm_theory_model)": predicted,
                     "gloo model": gloo, "socket bytes written (measured: gloo)": sock,
                     "measured / gloo model": sock / gloo if gloo else float("nan")})
    return rows


def activation_vs_theory(rows: list[dict], spec: ModelSpec | str, batch_size: int, seq_len: int) -> list[dict]:
    """Measured saved-activation bytes (:func:`labkit.experiments.tensor.activation_bytes` rows) beside the
    prediction (:func:`labkit.theory.tensor.activation_bytes_predicted`: labkit.theory.memory's items for the
    lab model, fp32, CPU kernels), per layer and in total (layers + embedding/head/loss items); "no re-gather"
    is predicted as TP+SP plus the gathered linear inputs it stores (Korthikanti et al. 2022, Section 4.2.2).
    Adds ``per_layer_measured``, ``per_layer_predicted``, ``total_predicted``, ``ratio_to_tp1_measured``.
    Raises ValueError for an unknown model or bad sizes."""
    if isinstance(spec, str):
        spec = get_spec(spec)
    full = next(r["bytes"] for r in rows if r["tp"] == 1)
    out = []
    for r in rows:
        pred = activation_bytes_predicted(spec, batch_size, seq_len, r["tp"],
                                          sequence_parallel=r["variant"].startswith("TP+SP"),
                                          regather="no re-gather" not in r["variant"])
        out.append({"variant": r["variant"], "tp": r["tp"], "per_layer_measured": r["per_layer"][0],
                    "per_layer_predicted": pred["per_layer"], "total_measured": r["bytes"],
                    "total_predicted": pred["total"], "ratio_to_tp1_measured": r["bytes"] / full})
    return out
