"""Published references: every row has its source URL, read date, units and the hardware; the loader labels them."""

from __future__ import annotations

import datetime

import pandas as pd
import pytest

from labkit.runtime import records

KINDS = list(records.PUBLISHED)


@pytest.mark.parametrize("kind", KINDS)
def test_every_row_has_a_url_a_date_and_a_label(kind):
    df = records.load_published(kind)
    assert len(df) >= 5
    assert df["url"].str.match(r"^https://").all(), df.loc[~df["url"].str.match(r"^https://"), "url"]
    dates = pd.to_datetime(df["read_on"], format="%Y-%m-%d")
    assert (dates <= pd.Timestamp(datetime.date.today()) + pd.Timedelta(days=1)).all()
    assert (df["label"] == "published (" + df["source"] + ")").all()
    assert df["what"].str.len().gt(10).all()
    assert "published" in df.attrs["status"]


def test_collective_rows_are_bandwidths_with_hardware():
    df = records.load_published("collectives")
    assert set(df["metric"]) <= {"busbw", "algbw", "time"} and set(df["role"]) == {"calibration", "validation"}
    timed = df["metric"] == "time"
    assert (df.loc[~timed, "unit"] == "GB/s").all() and (df.loc[timed, "unit"] == "us").all()
    df = df[df["metric"] != "time"]  # small-message latencies (us) are checked in tests/test_nccl_model.py
    assert set(df["kind"]) <= {"measured", "quoted"}
    assert {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"} <= set(df["op"])
    assert (df["value"] > 0).all() and (df["value"] < 2000).all()  # GB/s of one GPU's bus: not bytes, not Gb/s
    sized = df[df["bytes"].notna()]
    assert (sized["bytes"] >= 1).all() and len(sized) >= 20
    assert df["gpu"].str.contains("H100|A100|H200").all()
    multi = df[df["nodes"] > 1]
    assert len(multi) >= 10 and multi["interconnect"].str.contains("InfiniBand|RoCE|not stated").all()
    assert (df["world_size"].dropna() == (df["nodes"] * df["gpus_per_node"]).dropna()).all()


def test_training_rows_carry_their_configuration():
    df = records.load_published("training")
    assert df["source"].nunique() >= 5
    full = df.dropna(subset=["tp", "pp", "dp"])
    assert len(full) >= 6  # another issue validates the planner against these
    # the mesh multiplies out to the GPU count, except where the source itself is inconsistent (said in the note)
    prod = full["tp"] * full["pp"] * full["dp"] * full["cp"].fillna(1)
    off = full[prod != full["gpus"]]
    assert off["note"].str.contains("as printed").all(), off[["source", "gpus", "tp", "pp", "dp", "cp"]]
    assert df["mfu"].dropna().between(0.05, 0.9).all()  # a fraction, not a percentage
    assert df["tflops_per_gpu"].dropna().between(10, 2000).all()
    assert df[["tflops_per_gpu", "mfu", "tokens_per_s_per_gpu"]].notna().any(axis=1).all()
    llama = df[df["model"] == "Llama 3 405B"]
    assert set(llama["tflops_per_gpu"]) == {430.0, 400.0, 380.0}


def test_pipeline_rows_are_fractions():
    df = records.load_published("pipeline")
    assert set(df["unit"]) == {"fraction"} and df["value"].between(0, 1).all()
    assert df["baseline"].notna().all()


def test_bad_kind_missing_file_and_empty_cell(tmp_path):
    with pytest.raises(ValueError, match="valid: collectives, training, pipeline"):
        records.load_published("bubbles")
    with pytest.raises(ValueError, match="does not exist"):
        records.load_published("pipeline", root=tmp_path)
    good = records.load_published("pipeline")
    bad = good.drop(columns="label").copy()
    bad.loc[1, "url"] = None
    bad.to_csv(tmp_path / "pipeline.csv", index=False)
    with pytest.raises(ValueError, match="'url' is empty in row"):
        records.load_published("pipeline", root=tmp_path)
    bad = good.drop(columns="label").copy()
    bad["value"] = bad["value"].astype(object)
    bad.loc[0, "value"] = "lots"
    bad.to_csv(tmp_path / "pipeline.csv", index=False)
    with pytest.raises(ValueError, match="'value' holds 'lots'"):
        records.load_published("pipeline", root=tmp_path)
