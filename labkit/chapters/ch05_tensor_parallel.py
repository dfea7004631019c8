"""Chapter 05 (notebooks/05_tensor_parallel.ipynb): tensor and sequence parallelism.

The chapter's parameter check (:func:`check_chapter`, before any launch), its one launch
(:func:`chapter_rank`), the tables it sets measured beside predicted (:func:`step_bytes_table`,
:func:`activation_vs_theory`) and the sentences it prints from the numbers (:func:`step_time_findings`).
The strategy is :mod:`labkit.parallel.tensor`, its formulas :mod:`labkit.theory.tensor`, the rank functions
:mod:`labkit.experiments.tensor`.
"""

from __future__ import annotations

from labkit.chapters.common import (
    as_emulate,
    check_fits_in_memory,
    check_prediction,
    check_steps,
    check_world_size,
    span,
)
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


def check_chapter(*, world_size, emulate=None, my_prediction=None, emulate_tp=None,
                  emulate_model: str = "llama-3-8b", emulate_seq_len=4096, model: str = "lab-tiny-llama",
                  gelu_model: str = "lab-tiny-gpt", batch_size=2, seq_len=16, train_steps=2, time_batch_size=4,
                  time_seq_len=64, time_steps=3, timeout_s=300.0) -> dict:
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

    The emulated section: ``emulate`` (None: skipped) a cluster profile; ``emulate_tp`` (None: the largest tp
    the model allows within one node, :func:`emulated_tp_degree`) at least 2, splitting ``model`` and fitting in
    one node; ``emulate_model`` a known dense preset and ``emulate_seq_len`` within its ``max_seq_len``;
    ``my_prediction`` None or a number.

    Returns ``{"world_size", "dtensor_parity": SP flags to check (for ``tp_check_rank(dtensor=...)``),
    "time_variants": (...), "skipped": {variant: reason}, "emulate_tp": int or None}``.
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
    check_steps("train_steps", train_steps)
    check_steps("time_steps", time_steps)
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
    check_prediction(my_prediction, what="a number (step time across nodes / inside one node, e.g. 1.5)")
    emulate = as_emulate(emulate)
    etp = None
    if emulate is not None:
        etp = _check_emulated(emulate, emulate_tp, emulate_model, emulate_seq_len, spec)
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
            "skipped": skipped, "emulate_tp": etp}


def _check_emulated(emulate, emulate_tp, emulate_model, emulate_seq_len, spec) -> int:
    """The emulated section's parameters (see :func:`check_chapter`); returns the tp it runs at."""
    from labkit.runtime.emulate import resolve
    from labkit.theory.cluster import get_cluster

    try:
        cluster = get_cluster(emulate)
    except ValueError as e:
        raise ValueError(f"emulate={emulate!r}: {e}; or emulate=None (no emulated section)") from None
    limit = cluster.gpus_per_node
    tp = emulated_tp_degree(spec.name, limit=limit) if emulate_tp is None else positive_int("emulate_tp", emulate_tp,
                                                                                          minimum=2)
    if tp > limit:
        raise ValueError(f"emulate_tp={tp} does not fit in one {cluster.name} node ({limit} GPUs); the section "
                         f"compares one node with several: use emulate_tp <= {limit}")
    try:
        check_tp(spec, tp, pad_vocab=True)
    except ValueError as e:
        raise ValueError(f"emulate_tp={tp}: {e}") from None
    big = get_spec(emulate_model)
    if big.is_moe:
        raise ValueError(f"emulate_model={emulate_model!r} is a mixture-of-experts model; use a dense preset, "
                         "e.g. llama-3-8b")
    big.check_seq_len(positive_int("emulate_seq_len", emulate_seq_len), "emulate_seq_len")
    resolve(_charge(cluster, spec.name, big.name, emulate_seq_len, 2, 32), tp)
    return tp


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
    dispatch = ("hand" in step_s and "dtensor" in slower and "hand" not in slower)  # same collectives as hand
    comm_slower = [v for v in slower if not (dispatch and v == "dtensor")]
    if comm_slower:
        text += (f" {', '.join(comm_slower)} ran slower than one rank: in this run the collectives TP adds to every "
                 "layer cost more than the arithmetic it split.")
    if dispatch:
        text += " dtensor ran slower than one rank although the hand-written TP did not."
    if faster:
        text += f" {', '.join(faster)} ran faster than one rank: the split arithmetic outweighed the collectives."
    if "hand" in step_s and "dtensor" in step_s and median(step_s["dtensor"]) > median(step_s["hand"]) * (1 + near):
        text += (f" DTensor issues the same collectives as the hand-written TP, so its "
                 f"{median(step_s['dtensor']) / median(step_s['hand']):.2f}x of hand's step is its own per-operator "
                 "work (placement propagation, redistribution checks), not communication.")
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


# ------------------------------------------------------------------------------------------------------
# TP inside a node vs across nodes: one emulated launch, re-priced on each placement
# ------------------------------------------------------------------------------------------------------
def emulated_tp_degree(model: str = "lab-tiny-llama", *, limit: int = 8) -> int:
    """The largest power-of-two tp <= ``limit`` the lab model can be split into (:func:`check_tp`, vocabulary
    padded): the degree of the emulated run when ``emulate_tp`` is None. Raises ValueError when the model
    cannot be split over 2 ranks."""
    spec = get_spec(model)
    best = None
    for tp in (2, 4, 8, 16):
        if tp > limit:
            break
        try:
            check_tp(spec, tp, pad_vocab=True)
            best = tp
        except ValueError:
            pass
    if best is None:
        raise ValueError(f"model={model!r} cannot be split over 2 ranks; use lab-tiny-llama")
    return best


def placements(tp: int) -> list[int]:
    """GPUs per node to re-price a tp-rank TP group on: all in one node, then spread over 2, 4, ... nodes."""
    out, g = [], tp
    while g >= 1:
        out.append(g)
        g //= 2
    return out[:3]


def _charge(cluster, model: str, as_model: str, as_seq_len: int, batch_size: int, seq_len: int) -> dict:
    return {"cluster": cluster, "model": as_model, "seq_len": as_seq_len, "micro_batch_size": 1, "lab_model": model,
            "lab_seq_len": seq_len, "lab_micro_batch_size": batch_size, "default_dim": "tp"}


def predicted_tp_step(cluster, tp: int, as_model: str, as_seq_len: int) -> dict:
    """Theory for one TP training step of ``as_model`` (micro-batch 1, ``as_seq_len`` tokens, bf16) on
    ``cluster``'s placement: compute = 6·N + attention FLOPs per token (:func:`labkit.theory.spec.flops_per_token`)
    x tokens / tp at the device's bf16 peak x compute_efficiency; communication = 4 all-reduces per layer
    (2 forward, 2 backward; Shoeybi et al. 2019) of b·s·h·2 bytes, each timed by
    :func:`labkit.theory.costmodel.group_collective_time` for ranks 0..tp-1 on that placement. Seconds."""
    from labkit.theory import costmodel
    from labkit.theory.spec import flops_per_token

    big = get_spec(as_model)
    compute = (flops_per_token(big, as_seq_len) * as_seq_len / tp
               / (cluster.device.peak_flops("bf16") * cluster.compute_efficiency))
    one = costmodel.group_collective_time("all_reduce", as_seq_len * big.hidden_size * 2, list(range(tp)),
                                          gpus_per_node=cluster.gpus_per_node, intra=cluster.intra,
                                          inter=cluster.inter, nics_per_node=cluster.nics_per_node,
                                          link_efficiency=cluster.link_efficiency)
    return {"compute_s": compute, "comm_s": 4 * big.n_layers * one, "step_s": compute + 4 * big.n_layers * one}


def tp_across_nodes(tp: int, *, emulate="dgx-h100", model: str = "lab-tiny-llama", as_model: str = "llama-3-8b",
                    as_seq_len: int = 4096, batch_size: int = 2, seq_len: int = 32, steps: int = 1,
                    timeout_s: float = 300.0) -> list[dict]:
    """One emulated launch of ``tp`` ranks running hand-written TP training steps of ``model``
    (:func:`~labkit.experiments.tensor.step_time_rank`, variant ``hand``), charged as ``as_model`` at
    ``as_seq_len`` tokens on ``emulate``'s cluster, then re-priced (no re-run) with the TP group spread over more
    nodes (:func:`placements`). One row per placement: ``placement``, ``nodes``, ``label``, ``step_s`` (median
    emulated step), ``comm_s`` (emulated TP communication in the step, rank 0), ``compute_s`` (the rest),
    ``predicted_step_s`` / ``predicted_comm_s`` (:func:`predicted_tp_step`). Raises ValueError when ``tp`` does
    not fit in one node of the cluster (this section compares one node with several)."""
    from labkit import launch
    from labkit.theory.cluster import get_cluster

    base = get_cluster(emulate)
    if tp > base.gpus_per_node:
        raise ValueError(f"emulate_tp={tp} does not fit in one {base.name} node ({base.gpus_per_node} GPUs): this "
                         f"section compares one node with several; use emulate_tp <= {base.gpus_per_node}")
    res = launch(step_time_rank, tp, model, ("hand",), batch_size=batch_size, seq_len=seq_len, steps=steps,
                 warmup=1, emulate=_charge(base, model, as_model, as_seq_len, batch_size, seq_len),
                 timeout_s=timeout_s, echo=False)
    rows = []
    for gpn in placements(tp):
        cl = base if gpn == tp else base.replace(gpus_per_node=gpn, name=f"{base.name}, {gpn} per node")
        emu = res.emulation if cl is base else res.emulation.reprice(
            _charge(cl, model, as_model, as_seq_len, batch_size, seq_len))
        df = emu.retime(res.timeline)
        spans = df[(df["name"] == "hand step") & (df["step"] >= 1) & (df["rank"] == 0)]
        comm = df[(df["kind"] == "comm") & (df["rank"] == 0)]
        step_s, comm_s = [], []
        for s, e in zip(spans["start_ns"], spans["end_ns"]):
            inside = comm[(comm["start_ns"] >= s) & (comm["end_ns"] <= e)]
            step_s.append((e - s) / 1e9)
            comm_s.append(float((inside["end_ns"] - inside["start_ns"]).sum()) / 1e9)
        k = len(step_s) // 2
        pred = predicted_tp_step(cl, tp, as_model, as_seq_len)
        nodes = -(-tp // gpn)
        rows.append({"placement": "one node" if nodes == 1 else f"{nodes} nodes", "nodes": nodes, "label": emu.label,
                     "step_s": sorted(step_s)[k], "comm_s": sorted(comm_s)[k],
                     "compute_s": sorted(step_s)[k] - sorted(comm_s)[k], "predicted_step_s": pred["step_s"],
                     "predicted_comm_s": pred["comm_s"]})
    return rows


def node_findings(rows: list[dict], tp: int) -> str:
    """What the emulated placements showed, computed from :func:`tp_across_nodes`'s rows: how much longer the
    step is when the TP group leaves the node, and whether its collectives then cost more than its arithmetic."""
    one, far = rows[0], rows[-1]
    ratio = far["step_s"] / one["step_s"]
    share = [r["comm_s"] / r["step_s"] for r in rows]
    text = (f"At tp={tp}, TP's collectives take {share[0]:.0%} of the emulated step inside one node and "
            f"{share[-1]:.0%} with the group spread over {far['nodes']} nodes, where the step is {ratio:.1f}x "
            f"as long ({one['step_s'] * 1e3:.1f} -> {far['step_s'] * 1e3:.1f} ms; predicted "
            f"{far['predicted_step_s'] / one['predicted_step_s']:.1f}x).")
    if far["comm_s"] > far["compute_s"]:
        text += (" Across nodes the collectives cost more than the arithmetic TP splits, and no layer can start "
                 "before its all-reduce ends: this is why TP stays inside the NVLink domain and the other "
                 "dimensions (data, pipeline, context) cross the network.")
    else:
        text += (" Even across nodes the collectives cost less than the arithmetic here, so on this cluster and "
                 "model TP could leave the node at a modest cost.")
    if share[0] > 0.5:
        text += " Inside the node they already exceed half the step: a smaller tp would pay more."
    return text


def prediction_inputs(rows: list[dict]) -> dict:
    """Keyword arguments for :func:`labkit.chapters.common.compare_prediction`: the reader guessed how many
    times longer the TP step is with the group spread over the most nodes than inside one node."""
    one, far = rows[0], rows[-1]
    return dict(measured=far["step_s"] / one["step_s"], predicted=far["predicted_step_s"] / one["predicted_step_s"],
                what=f"step time, {far['placement']} / one node", unit="x", measured_label=one["label"].split(",")[0]
                + ")", predicted_label="predicted (compute + 4L all-reduces)")


def nodes_figure(rows: list[dict], as_model: str, tp: int):
    """The headline: the emulated step per placement beside the predicted one (compute at peak x efficiency +
    4L all-reduces); each bar says what share of it the TP all-reduces take."""
    import plotly.graph_objects as go

    from labkit.style import label_color

    x = [r["placement"] for r in rows]
    emu = rows[0]["label"]
    pred = "predicted (compute + 4L all-reduces)"
    fig = go.Figure()
    for name, step, comm in ((emu, "step_s", "comm_s"), (pred, "predicted_step_s", "predicted_comm_s")):
        fig.add_trace(go.Bar(x=x, y=[r[step] * 1e3 for r in rows], name=name, marker_color=label_color(name),
                             text=[f"{r[step] * 1e3:.0f} ms, {r[comm] / r[step]:.0%} all-reduces" for r in rows],
                             textposition="outside"))
    fig.update_layout(barmode="group", yaxis_title="ms per training step",
                      title=f"One TP training step of {as_model} at tp={tp}: the group inside one node (NVLink) vs "
                            "spread over nodes (InfiniBand)")
    return fig


def wire_findings(wire) -> str:
    """The socket bytes (measured) against gloo's algorithms (model), from :func:`step_bytes_table` as a frame."""
    r = wire.set_index("variant")["measured / gloo model"].dropna()
    if r.empty:
        return "No socket bytes were measured on this backend (gloo only)."
    which = ("every variant" if span(r.min(), r.max()) == span(r.min(), r.min()) else
             f"lowest: {r.idxmin()}, highest: {r.idxmax()}")
    return (f"What left each rank's sockets is {span(r.min(), r.max(), unit='x')} gloo's algorithm model "
            f"({which}): "
            + ("the excess is message headers, a larger share the smaller each message." if r.min() >= 1 else
               "below the model: some bytes did not go through the measured sockets."))


def activation_findings(act, tp: int) -> str:
    """Saved activations (measured) relative to the unsharded model, from :func:`activation_vs_theory` rows."""
    t = act.set_index("variant")["ratio_to_tp1_measured"]
    sp, plain = float(t["TP+SP"]), float(t["TP"])
    return (f"Measured saved activations per rank, relative to the unsharded model: TP {plain:.2f}, TP+SP {sp:.2f} "
            f"(1/tp = {1 / tp:.2f}). " + ("TP alone stays well above 1/tp: the norms' inputs and outputs and the "
            "linear "
            "layers' inputs are whole on every rank; SP splits them too." if plain > 1.2 / tp else
            "TP alone is already near 1/tp here."))


def wire_figure(wire, tp: int):
    """Bytes one rank sent in one training step per variant: measured on its sockets (gloo) beside the two
    predictions of those bytes (gloo's algorithms, and the ring of the nccl-tests convention)."""
    import plotly.graph_objects as go

    from labkit.style import label_color

    fig = go.Figure()
    for name, col in (("measured", "socket bytes written (measured: gloo)"),
                      ("predicted (gloo algorithms)", "gloo model"),
                      ("predicted (ring: 2(tp-1)/tp x S per all-reduce)", "ring bytes (predicted: comm_theory_model)")):
        fig.add_trace(go.Bar(x=wire["variant"], y=wire[col] / 2**10, name=name, marker_color=label_color(name)))
    fig.update_layout(barmode="group", yaxis_title="KiB per rank per step",
                      title=f"Bytes one rank sends in one TP training step, tp={tp}: measured on its sockets vs "
                            "predicted")
    return fig


def activation_figure(act, tp: int):
    """Saved activations per layer and rank: measured (saved-tensor hooks) beside labkit.theory.memory's items."""
    import plotly.graph_objects as go

    from labkit.style import label_color

    fig = go.Figure()
    for name, col in (("measured", "per_layer_measured"), ("predicted (labkit.theory.memory)", "per_layer_predicted")):
        fig.add_trace(go.Bar(x=act["variant"], y=act[col] / 2**10, name=name, marker_color=label_color(name)))
    fig.update_layout(barmode="group", yaxis_title="KiB per layer and rank",
                      title=f"Saved activations per layer and rank (forward + loss), tp={tp}")
    return fig
