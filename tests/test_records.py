"""Run records: identity, round trip, atomic writes, listing."""

import os

import pandas as pd
import pytest

from labkit.runtime import records


def test_save_load_roundtrip(tmp_path):
    tl = pd.DataFrame({"rank": [0, 1], "name": ["F", "F"], "kind": ["compute"] * 2, "start_ns": [0, 5],
                       "end_ns": [3, 9], "step": [0, 0], "microbatch": [0, 0], "stage": [-1, -1], "nbytes": [0, 0]})
    path = records.save("demo-run", {"world_size": 2, "lr": 1e-3}, metrics=[{"step": 0, "loss": 5.5}],
                        timeline=tl, tables={"extra": pd.DataFrame({"a": [1]})}, root=tmp_path,
                        world_size=2, backend="gloo")
    rec = records.load(path)
    ident = rec.identity
    for key in ("experiment", "params", "git_sha", "torch", "backend", "world_size", "host", "cpu_cores", "gpus",
                "start_time", "python"):
        assert key in ident, key
    assert ident["params"]["lr"] == 1e-3 and ident["world_size"] == 2 and ident["backend"] == "gloo"
    assert rec.metrics.loc[0, "loss"] == 5.5
    pd.testing.assert_frame_equal(rec.timeline, tl)
    assert rec.tables["extra"].loc[0, "a"] == 1
    listed = records.list(tmp_path)
    assert listed.loc[0, "experiment"] == "demo-run" and listed.loc[0, "path"] == str(path)


def test_interrupted_save_leaves_no_record(tmp_path):
    with pytest.raises(ValueError, match="table name"):
        records.save("x", tables={"../evil": pd.DataFrame({"a": [1]})}, root=tmp_path)
    assert os.listdir(tmp_path) == []  # neither a record nor a temporary folder
    # a half-written temporary folder (e.g. from a killed process) is not listed
    (tmp_path / ".tmp-20260101T000000_x_abc").mkdir()
    (tmp_path / ".tmp-20260101T000000_x_abc" / "identity.json").write_text("{}")
    assert records.list(tmp_path).empty


def test_bad_names_and_missing_record(tmp_path):
    with pytest.raises(ValueError, match="experiment="):
        records.save("a b", root=tmp_path)
    with pytest.raises(ValueError, match="not a run record"):
        records.load(tmp_path)
    assert records.list(tmp_path / "nowhere").empty
