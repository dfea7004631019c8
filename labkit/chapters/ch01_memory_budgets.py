"""Chapter 01 (memory budgets): its parameter check and the predicted-only tables it shows.

The rank function it launches is :func:`labkit.experiments.memory.measure_training_rank` (one AdamW step alone,
under DDP and under FSDP2, measured beside the prediction); every number it predicts comes from
:mod:`labkit.theory.memory`.
"""

from __future__ import annotations

import pandas as pd

from labkit.chapters.common import as_emulate, check_world_size
from labkit.checks import positive_float
from labkit.experiments.memory import WRAPS, check_training_run
from labkit.theory import memory as mem
from labkit.theory.spec import get_spec

KiB = 1024
#: the layouts the launch measures, in order: one rank alone (the reference), DDP, FSDP2
LAYOUTS = WRAPS
#: the budget's categories a training table shows (kv_cache is the serving budget's)
TRAIN_COLUMNS = ("parameters", "gradients", "optimizer", "activations", "temporary", "communication", "workspace",
                 "headroom")
#: Llama-3-70B training layouts on 64-512 GPUs (section 4)
LARGE_LAYOUTS = (dict(dp=64, zero=3),
                 dict(dp=8, tp=8, zero=1, sequence_parallel=True),
                 dict(dp=4, tp=8, pp=2, zero=1, sequence_parallel=True),
                 dict(dp=16, tp=8, zero=1, sequence_parallel=True),
                 dict(dp=16, tp=8, pp=2, zero=1, sequence_parallel=True),
                 dict(dp=64, tp=8, zero=1, sequence_parallel=True),
                 dict(dp=16, tp=8, pp=4, zero=1, sequence_parallel=True))
#: the training step of section 4: sequence 8192, micro-batch 1, 16 micro-batches, selective recompute, flash
LARGE_TRAIN = dict(micro_batch_size=1, seq_len=8192, n_microbatches=16, recompute="selective", attention="flash")


def device_for(cluster, device) -> str:
    """The device the large-model tables are sized against: ``device`` when given, else the GPU of the
    ``cluster`` profile (``h100-80gb`` for ``dgx-h100``), else ``h100-80gb``. Nothing in chapter 01 is emulated:
    the cluster only names a GPU."""

    cluster = as_emulate(cluster)
    if device is not None:
        return device
    if cluster is None:
        return "h100-80gb"
    from labkit.runtime.emulate import resolve

    return resolve(cluster).cluster.device.name


def check_chapter(*, world_size, cluster, my_prediction, model: str, micro_batch_size, seq_len, attention: str,
                  big_model: str, device, timeout_s) -> dict:
    """Validate chapter 01's parameters before any launch; returns
    :func:`labkit.experiments.memory.check_training_run`'s dict (``summary``: the host memory the launch needs,
    predicted, beside this machine's).

    Raises ValueError naming the value and the fix: world_size >= 2 (DDP replicates and FSDP2 shards over the
    ranks: one rank shards nothing); ``cluster`` a cluster profile or None (its GPU sizes the large-model tables
    when ``device`` is None); ``my_prediction`` None or a number; ``big_model`` a preset and ``device`` a device
    of data/hardware.yaml or None (the large-model tables); timeout_s > 0; and whatever
    :func:`check_training_run` refuses for the launch (an unknown or mixture-of-experts ``model`` — its
    activations are only estimated, so measured cannot equal predicted —, micro_batch_size < 1, seq_len beyond
    the model's max_seq_len, an unknown ``attention``, or a model this machine's memory cannot hold on
    ``world_size`` ranks)."""
    world_size = check_world_size("01", world_size,
                                  why="DDP replicates and FSDP2 shards over the ranks: one rank shards nothing")
    from labkit.chapters.ch00_getting_started import check_emulate
    from labkit.chapters.common import check_prediction

    try:
        check_emulate(cluster, None)
    except ValueError as e:
        raise ValueError(f"cluster={cluster!r} (whose GPU sizes the large-model tables): {e}") from None
    check_prediction(my_prediction, what="a number (how many times fewer model-state bytes FSDP2 leaves on rank 0 "
                                    "than DDP, e.g. 2)")
    device = device_for(cluster, device)
    for name, check, value in (("big_model", get_spec, big_model), ("device", mem.get_device, device)):
        try:
            check(value)
        except ValueError as e:
            raise ValueError(f"{name}={value!r} (the large-model tables): {e}") from None
    positive_float("timeout_s", timeout_s)
    return check_training_run(model, world_size, micro_batch_size=micro_batch_size, seq_len=seq_len,
                              attention=attention, wraps=LAYOUTS, exact_activations=True)


def measure(world_size: int, model: str, *, micro_batch_size: int, seq_len: int, attention: str,
            timeout_s: float = 240.0) -> dict:
    """Section 2's launch: :func:`labkit.experiments.memory.measure_training_rank` for :data:`LAYOUTS` on
    ``world_size`` ranks. Returns ``{"result", "cmp"`` (:func:`labkit.experiments.memory.comparison_frame`),
    ``"findings"`` (:func:`fsdp_findings`)}."""
    from labkit.experiments import memory as experiment
    from labkit.runtime.launcher import launch

    res = launch(experiment.measure_training_rank, world_size, model, micro_batch_size=micro_batch_size,
                 seq_len=seq_len, attention=attention, wraps=LAYOUTS, timeout_s=timeout_s)
    cmp = experiment.comparison_frame(res)
    return {"result": res, "cmp": cmp, "findings": fsdp_findings(cmp, world_size)}


#: the model-state categories (what ZeRO shards)
STATES = ("parameters", "gradients", "optimizer")


def fsdp_findings(cmp: pd.DataFrame, world_size: int) -> dict:
    """What section 2's run shows about sharding, as numbers and sentences written from them: model-state bytes
    (parameters + gradients + optimizer) per rank under DDP and under FSDP2 (rank 0, the largest shard),
    measured and predicted; the saving ``ddp / fsdp2`` beside the ideal ``world_size``; whether every FSDP2 rank
    holds the same bytes (``even``) or rank 0 more than the last rank (dim-0 chunks of ⌈d₀ / n⌉ rows).
    Returns ``{"saving_measured", "saving_predicted", "ddp_bytes", "fsdp2_bytes", "even", "spread_bytes",
    "sentence"}``."""
    states = cmp[cmp["category"].isin(STATES)]
    tot = states.groupby(["wrap", "rank"])[["measured_bytes", "predicted_bytes"]].sum()
    ddp, f0 = tot.loc[("ddp", 0)], tot.loc[("fsdp2", 0)]
    per_rank = tot.loc["fsdp2", "measured_bytes"]
    spread = int(per_rank.max() - per_rank.min())
    save_m = float(ddp["measured_bytes"] / f0["measured_bytes"])
    save_p = float(ddp["predicted_bytes"] / f0["predicted_bytes"])
    kib = 1024
    s = [f"Model states per rank: DDP {ddp['measured_bytes'] / kib:,.1f} KiB, FSDP2 rank 0 "
         f"{f0['measured_bytes'] / kib:,.1f} KiB (measured): FSDP2 saves {save_m:.2f}x (predicted {save_p:.2f}x) "
         f"on {world_size} ranks, "]
    if save_m >= 0.98 * world_size and spread == 0:
        s.append(f"within 2% of the ideal {world_size}x (the rest: AdamW's step counts, one per tensor on every "
                 "rank).")
    else:
        s.append(f"{1 - save_m / world_size:.1%} short of the ideal {world_size}x: AdamW's step counts stay one per "
                 "tensor on every rank" + (", and rank 0 holds the largest dim-0 chunk." if spread else "."))
    if spread == 0:
        s.append(f" Every rank holds the same FSDP2 bytes: {world_size} divides every tensor's first dimension.")
    else:
        s.append(f" The ranks hold different FSDP2 bytes (rank 0 up to {spread:,} bytes more than another): "
                 f"{world_size} does not divide every tensor's first dimension, so the dim-0 chunks of "
                 f"⌈d₀ / {world_size}⌉ rows leave the last rank fewer.")
    return {"saving_measured": save_m, "saving_predicted": save_p, "ddp_bytes": int(ddp["measured_bytes"]),
            "fsdp2_bytes": int(f0["measured_bytes"]), "even": spread == 0, "spread_bytes": spread,
            "sentence": "".join(s)}


def large_findings(big: pd.DataFrame, device: str) -> str:
    """Sentences written from :func:`large_training_rows`: which layouts fit ``device`` and which do not, and for
    the pure-FSDP row (tp = pp = 1, ZeRO-3), its activations beside its parameters — the share of the peak that
    sharding model states cannot remove."""
    gib = 2**30
    fit = big[big["fits"].astype(bool)]
    out = [f"{len(fit)} of {len(big)} layouts fit {device} (predicted)"
           + (f"; the smallest that fits is {fit.sort_values('world_size').iloc[0]['label']}." if len(fit) else ".")]
    fsdp = big[(big["tp"] == 1) & (big["pp"] == 1) & (big["zero"] == 3)]
    if len(fsdp):
        r = fsdp.iloc[0]
        share = r["activations"] / r["total_bytes"]
        out.append(f"FSDP alone ({r['label']}) shards the weights to {r['parameters'] / gib:.1f} GiB per GPU but keeps "
                   f"{r['activations'] / gib:.0f} GiB of activations ({share:.0%} of its peak) on every GPU, and "
                   + ("does not fit: it needs full recompute or tensor / context parallelism." if not r["fits"]
                      else "still fits."))
    tp = big[big["tp"] > 1]
    if len(tp) and len(fsdp):
        lo, hi = f"{tp['activations'].min() / gib:.0f}", f"{tp['activations'].max() / gib:.0f}"
        out.append(f"With TP={int(tp.iloc[0]['tp'])} and sequence parallelism the activations fall to "
                   f"{lo if lo == hi else lo + '–' + hi} GiB per GPU.")
    return " ".join(out)


def pending_layouts(world_size: int) -> dict[str, mem.ParallelConfig]:
    """Layouts this chapter predicts but does not run (ZeRO-1 and ZeRO-2 over ``world_size`` ranks, TP=2, TP=2
    with sequence parallelism; chapters 04 and 05 run them), by label, for the predicted-only table."""
    out = {f"ZeRO-{z}, dp={world_size}": mem.ParallelConfig(dp=world_size, zero=z) for z in (1, 2)}
    out["TP=2"] = mem.ParallelConfig(tp=2)
    out[f"TP=2 + SP, dp={world_size // 2 or 1}"] = mem.ParallelConfig(tp=2, dp=max(1, world_size // 2),
                                                                      sequence_parallel=True)
    return out


def predicted_only_table(spec, train: mem.TrainConfig, world_size: int) -> pd.DataFrame:
    """Model states and activations of :func:`pending_layouts` for ``spec`` and ``train``, KiB per rank
    (predicted, no headroom or workspace), one row per layout."""
    pred = pd.DataFrame({k: mem.train_memory(spec, v, train, headroom=0.0, workspace_bytes=0).categories
                         for k, v in pending_layouts(world_size).items()}).T
    pred = pred[["parameters", "gradients", "optimizer", "activations"]]
    return (pred / KiB).round(1).rename(columns=lambda c: f"{c} KiB (predicted)")


def large_training_rows(big_model: str, device: str) -> pd.DataFrame:
    """:func:`labkit.theory.memory.layout_rows` of ``big_model`` for :data:`LARGE_LAYOUTS` with
    :data:`LARGE_TRAIN` (bytes, predicted), plus a ``label`` per row ("64 GPUs: dp64 tp1 pp1 z3")."""
    big = pd.DataFrame(mem.layout_rows(big_model, LARGE_LAYOUTS, device=device, **LARGE_TRAIN))
    big["label"] = big.apply(lambda r: f"{r.world_size} GPUs: dp{r.dp} tp{r.tp} pp{r.pp} z{r.zero}", axis=1)
    return big


def large_training_table(big: pd.DataFrame, device: str) -> pd.DataFrame:
    """:func:`large_training_rows` as a table: every :data:`TRAIN_COLUMNS` category and the peak in GiB per GPU
    (predicted, 1 decimal), and whether it fits ``device``."""
    cols = list(TRAIN_COLUMNS)
    table = (big.set_index("label")[cols + ["total_bytes"]] / mem.GiB).round(1)
    table.columns = [f"{c} GiB (predicted)" for c in cols] + ["peak GiB (predicted)"]
    table[f"fits {device} (predicted)"] = big.set_index("label")["fits"]
    return table


def large_training_brief(big: pd.DataFrame, device: str):
    """:func:`large_training_table` as :func:`labkit.plots.wide_table`: the states, activations, peak and verdict
    shown, every category one click (or ``.full``) away."""
    from labkit.plots import wide_table

    t = large_training_table(big, device).reset_index()
    key = ["label"] + [f"{c} GiB (predicted)" for c in ("parameters", "optimizer", "activations")] + [
        "peak GiB (predicted)", f"fits {device} (predicted)"]
    return wide_table(t, key=key, caption=f"Predicted training memory per GPU against {device}")


def serving_table(big_model: str, device: str, *, tp: int = 8, batch: int = 32, prompt_len: int = 2048,
                  output_len: int = 512, weight_dtypes=("bf16", "int8", "int4")) -> pd.DataFrame:
    """Serving ``big_model`` with TP=``tp``: weights, KV cache and peak in GiB per GPU, whether it fits
    ``device`` and ``max_batch`` (the most concurrent sequences that still fit), one row per weight dtype — all
    predicted (:func:`labkit.theory.memory.serving_rows`)."""
    serve = pd.DataFrame(mem.serving_rows(big_model, [dict(batch=batch, prompt_len=prompt_len, output_len=output_len,
                                                           weight_dtype=w) for w in weight_dtypes],
                                          device=device, tp=tp))
    serve["weights GiB (predicted)"] = serve["parameters"] / mem.GiB
    serve["KV cache GiB (predicted)"] = serve["kv_cache"] / mem.GiB
    serve["peak GiB (predicted)"] = serve["total_bytes"] / mem.GiB
    serve = serve.rename(columns={"batch": "batch (sequences)", "fits": f"fits {device} (predicted)",
                                  "max_batch": "max_batch (predicted, sequences)"})
    return serve[["weight_dtype", "batch (sequences)", "weights GiB (predicted)", "KV cache GiB (predicted)",
                  "peak GiB (predicted)", f"fits {device} (predicted)", "max_batch (predicted, sequences)"]].round(2)


def layout_figure(cmp: pd.DataFrame, model: str):
    """Rank 0's memory per layout (:func:`labkit.experiments.memory.comparison_frame`): the measured bytes
    stacked by category, one bar per layout, and the predicted total as a mark on each — what the run shows is
    where the layouts differ (FSDP2 shards the model states, not the activations), not measured beside an equal
    predicted bar. KiB = 1024 bytes."""
    import plotly.graph_objects as go

    from labkit.style import _layout, label_color
    from labkit.widgets import CATEGORY_COLORS

    r0 = cmp[cmp["rank"] == 0]
    layouts = list(dict.fromkeys(r0["layout"]))
    fig = go.Figure()
    for cat in ("parameters", "gradients", "optimizer", "activations"):
        g = r0[r0["category"] == cat].set_index("layout").reindex(layouts)
        fig.add_bar(x=layouts, y=g["measured_bytes"] / KiB, name=f"{cat} (measured)",
                    marker_color=CATEGORY_COLORS.get(cat))
    total = r0.groupby("layout", sort=False)["predicted_bytes"].sum().reindex(layouts)
    fig.add_scatter(x=layouts, y=total / KiB, mode="markers", name="total (predicted)",
                    marker={"symbol": "line-ew-open", "size": 40, "line": {"width": 3},
                            "color": label_color("predicted")})
    fig.update_layout(barmode="stack", yaxis_title="memory on rank 0 (KiB)", xaxis_title="layout", height=440)
    return _layout(fig, f"Memory on rank 0 by layout, {model}: measured, stacked by category; predicted total "
                        "as a mark")


def per_layer_line(rank_result: dict) -> str:
    """One rank's saved activations per layer, measured against predicted, as a sentence (a bar chart of equal
    pairs shows nothing): equal on every layer (how many, bytes each), or the layers that differ with their
    ratio. ``rank_result``: one rank's row of :func:`measure` (``activations_per_layer``,
    ``predicted_per_layer``, bytes)."""
    meas, pred = list(rank_result["activations_per_layer"]), rank_result["predicted_per_layer"]
    pred = [pred] * len(meas) if isinstance(pred, (int, float)) else list(pred)  # one prediction for every layer
    off = [(i, m / p) for i, (m, p) in enumerate(zip(meas, pred)) if m != p]
    if not off:
        sizes = sorted(set(meas))
        each = f"{sizes[0]:,} bytes each" if len(sizes) == 1 else f"{min(sizes):,}-{max(sizes):,} bytes"
        return (f"Saved activations per layer (rank 0): measured = predicted on all {len(meas)} layers "
                f"({each}).")
    return ("Saved activations per layer (rank 0), measured / predicted where they differ: "
            + ", ".join(f"layer {i} {r:.4f}" for i, r in off) + ".")
