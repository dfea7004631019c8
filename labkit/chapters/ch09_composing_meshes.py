"""Chapter 09 (composing meshes): its parameter check, its memory figure, and the published-runs validation
table (the planner and the memory calculator beside published training runs).

The runs it launches are :func:`labkit.experiments.composed.run_composed` (the compositions of
:mod:`labkit.parallel.composed` beside the single-process reference), checked by
:func:`labkit.theory.composed.check_runs`; the plan is :mod:`labkit.theory.planner`'s. Figures use plotly
(imported lazily).
"""

from __future__ import annotations

from labkit.chapters.common import check_fits_in_memory, check_world_size
from labkit.checks import positive_float, positive_int
from labkit.theory.composed import check_runs
from labkit.theory.published import MFU_BAND, validate_published, validation_table
from labkit.theory.spec import get_spec


# ------------------------------------------------------------------------------------------------------
# parameters, checked before any launch
# ------------------------------------------------------------------------------------------------------
def check_chapter(*, world_size: int, model: str, steps: int, seq_len: int, n_microbatches: int, plan_model: str,
                  plan_gpus: int, plan_gpu: str, gpus_per_node: int, plan_seq_len: int, plan_global_batch: int,
                  timeout_s: float) -> dict:
    """Validate chapter 09's parameters before anything is launched (the chapter's first code cell) and return
    its real runs: ``{"runs", "dp", "global_batch_size"}`` — DP x TP (torch and hand-written) and PP x DP with
    tp = pp = 2 and dp = world_size / 2, ``global_batch_size`` = n_microbatches x dp sequences.

    Raises ValueError naming the value and the fix: world_size odd or < 2 (the 2-D runs put 2 ranks on tp or pp),
    a model or planner GPU that is not a preset, sizes < 1, a mesh the model cannot take (:func:`check_runs`), a
    model this machine's memory cannot hold on world_size ranks, a world that is not a whole number of nodes."""
    from labkit.theory.planner import DEFAULT_INTER_LINK, Topology

    world_size = check_world_size("09", world_size, why="the 2-D runs put 2 ranks on tp (or pp) and the rest on dp")
    if world_size % 2:
        raise ValueError(f"chapter 09 needs an even world_size (tp or pp = 2, dp = world_size / 2), got "
                         f"world_size={world_size}; use {world_size - 1} or {world_size + 1}")
    for name, value in (("steps", steps), ("seq_len", seq_len), ("n_microbatches", n_microbatches),
                        ("plan_gpus", plan_gpus), ("gpus_per_node", gpus_per_node), ("plan_seq_len", plan_seq_len),
                        ("plan_global_batch", plan_global_batch)):
        positive_int(name, value)
    positive_float("timeout_s", timeout_s)
    spec = get_spec(model)
    get_spec(plan_model)
    Topology.of(plan_gpu, gpus_per_node, DEFAULT_INTER_LINK).check_whole_nodes(plan_gpus, "plan_gpus")
    dp = world_size // 2
    runs = [{"kind": "dp_tp", "dp": dp, "tp": 2}, {"kind": "dp_tp_hand", "dp": dp, "tp": 2},
            {"kind": "pp_dp", "pp": 2, "dp": dp}]
    global_batch_size = n_microbatches * dp  # PP x DP: dp ranks x n_microbatches micro-batches of 1 sequence
    check_runs(runs, world_size, spec, global_batch_size=global_batch_size, seq_len=seq_len,
               n_microbatches=n_microbatches)
    check_fits_in_memory(spec, world_size, copies=2, what="chapter 09's composed runs (and the reference)")
    return {"runs": runs, "dp": dp, "global_batch_size": global_batch_size}


# ------------------------------------------------------------------------------------------------------
# figures
# ------------------------------------------------------------------------------------------------------
def memory_figure(memory, ranks):
    """Bars of model-state bytes per category, measured (live tensors) beside predicted
    (labkit.theory.memory), one panel per run and rank of ``ranks``, from ``ComposedResult.memory``."""
    import plotly.express as px

    mem_long = memory.melt(id_vars=["run", "rank", "stage", "category"],
                           value_vars=["measured_bytes", "predicted_bytes"], var_name="source", value_name="bytes")
    mem_long = mem_long[mem_long["rank"].isin(list(ranks))]
    mem_long["where"] = mem_long["run"] + ", rank " + mem_long["rank"].astype(str)
    fig = px.bar(mem_long, x="category", y="bytes", color="source", barmode="group", facet_col="where",
                 facet_col_wrap=3, height=520,
                 title="Model states per rank: measured (live tensors) vs predicted (labkit.theory.memory)")
    fig.update_yaxes(matches=None, showticklabels=True)
    return fig


# ------------------------------------------------------------------------------------------------------
# published runs: the planner and the calculator beside them
# ------------------------------------------------------------------------------------------------------
#: the columns the chapter's table shows, in order
COLUMNS = ("model", "gpus", "gpu", "tp", "pp", "dp", "cp", "accepted", "fits", "peak_gib", "layers_per_stage",
           "schedule", "recompute", "planner_rank", "n_ranked", "predicted_mfu", "published_mfu", "ratio", "flops",
           "source")


def validation_rows(**kwargs) -> list[dict]:
    """:func:`labkit.theory.published.validate_published` (``kwargs``: the planner's assumptions), validated
    runs only."""
    return [r for r in validate_published(**kwargs) if not r.get("skipped")]


def validation_frame(rows: list[dict] | None = None):
    """The validation as a pandas DataFrame (one row per published run, :data:`COLUMNS`), MFU columns labelled
    ``predicted`` and ``published``."""
    import pandas as pd

    rows = validation_rows() if rows is None else rows
    df = pd.DataFrame([{c: r.get(c) for c in COLUMNS} for r in rows])
    return df.rename(columns={"predicted_mfu": "MFU predicted", "published_mfu": "MFU published (source)"})


def validation_text(rows: list[dict] | None = None) -> str:
    """The table as text (what ``labkit plan --validate`` prints)."""
    return validation_table(rows)


def validation_findings(rows: list[dict] | None = None) -> str:
    """Sentences computed from the rows: how many published meshes the calculator accepts and fits, how the
    predicted MFU compares (median and worst ratio), and where the planner ranks the published meshes."""
    rows = validation_rows() if rows is None else rows
    n = len(rows)
    accepted = sum(bool(r["accepted"]) for r in rows)
    fits = sum(bool(r.get("fits")) for r in rows)
    ratios = sorted(r["ratio"] for r in rows if r.get("ratio") is not None)
    if not ratios:
        return f"{accepted} of {n} published meshes accepted, {fits} fit; no MFU to compare."
    med = ratios[len(ratios) // 2]
    worst = max(ratios, key=lambda x: abs(x - 1))
    top10 = sum(1 for r in rows if r.get("planner_rank") and r["planner_rank"] <= 10)
    lo, hi = MFU_BAND
    inside = sum(lo <= x <= hi for x in ratios)
    return (f"The calculator accepts {accepted} of {n} published meshes and finds {fits} of them fit. Predicted "
            f"MFU / published MFU: median {med:.2f}, furthest from 1 {worst:.2f}; {inside} of {len(ratios)} within "
            f"the band {lo:.2f}-{hi:.2f}. The planner ranks {top10} of the published meshes in its top 10.")


def check_validation(rows: list[dict] | None = None) -> None:
    """Raise AssertionError unless every validated published mesh is accepted and its predicted MFU is within
    :data:`MFU_BAND` of the published one (the chapter's check cell)."""
    rows = validation_rows() if rows is None else rows
    assert len(rows) >= 6, f"only {len(rows)} published runs validated"
    for r in rows:
        assert r["accepted"], f"{r['model']} on {r['gpus']}: refused: {r['error']}"
        lo, hi = MFU_BAND
        assert r.get("ratio") is not None and lo <= r["ratio"] <= hi, (
            f"{r['model']} on {r['gpus']}: predicted/published MFU {r.get('ratio')} outside {lo}-{hi}")
