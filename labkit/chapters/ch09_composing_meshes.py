"""Chapter 09 (composing meshes): the published-runs validation table and its findings.

For now this module holds only what the chapter needs to show the planner and the memory calculator beside
published training runs (one call each); the chapter's own parameter check and runs live in
:mod:`labkit.parallel.composed` until the chapter's layout move. Every number here is either *predicted*
(:mod:`labkit.theory.planner`) or *published* (data/reference/published/training.csv, with its source).
"""

from __future__ import annotations

from labkit.theory.published import MFU_BAND, validate_published, validation_table

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
