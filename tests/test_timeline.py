"""Timeline frames: merging, relative times, exposed communication, Chrome trace, the Gantt figure."""

import json

import pytest

from labkit.plots import timeline_figure
from labkit.runtime import timeline as tl


def _frame():
    a = tl.Timeline(rank=0)
    a.add("F", "compute", 0, 100, microbatch=0)
    a.add("all_reduce", "comm", 50, 150, nbytes=64)  # 50 of 100 ns overlapped by compute
    a.add("F", "compute", 140, 200, microbatch=1)  # overlaps the last 10 ns of comm
    b = tl.Timeline(rank=1, offset_ns=1000)  # its clock runs 1000 ns ahead of rank 0's
    b.add("F", "compute", 1010, 1090, microbatch=0)
    b.add("all_reduce", "comm", 1090, 1150, nbytes=64)
    return tl.concat([a.to_frame(), b.to_frame()])


def test_frame_columns_offset_and_order():
    df = _frame()
    assert list(df.columns) == tl.COLUMNS
    assert df["start_ns"].is_monotonic_increasing
    r1 = df[df["rank"] == 1]
    assert r1["start_ns"].tolist() == [10, 90]  # offset subtracted: on rank 0's clock
    rel = tl.relative(df)
    assert rel["start_s"].min() == 0 and (rel["dur_s"] >= 0).all()


def test_exposed_and_busy():
    df = _frame()
    ex = tl.exposed_ns(df)
    assert ex.loc[0, "total_ns"] == 100 and ex.loc[0, "hidden_ns"] == 60 and ex.loc[0, "exposed_ns"] == 40
    assert ex.loc[0, "hidden_fraction"] == pytest.approx(0.6)
    assert ex.loc[1, "hidden_ns"] == 0 and ex.loc[1, "exposed_ns"] == 60
    busy = tl.busy_ns(df)
    assert busy[0] == 160 and busy[1] == 80  # union of compute intervals [0,100] + [140,200]


def test_bad_events_rejected():
    t = tl.Timeline()
    with pytest.raises(ValueError, match="kind='gpu'"):
        t.add("x", "gpu", 0, 1)
    with pytest.raises(ValueError, match="before start"):
        t.add("x", "compute", 5, 1)


def test_span_records_even_when_block_raises():
    t = tl.Timeline(rank=3)
    with pytest.raises(RuntimeError):
        with t.span("boom", "compute", step=2):
            raise RuntimeError
    assert len(t) == 1 and t.to_frame().iloc[0]["step"] == 2 and t.to_frame().iloc[0]["rank"] == 3


def test_chrome_trace(tmp_path):
    df = _frame()
    path = tmp_path / "trace.json"
    trace = tl.to_chrome_trace(df, path)
    assert json.loads(path.read_text()) == trace
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(df)
    ar = [e for e in xs if e["name"] == "all_reduce" and e["pid"] == 0][0]
    assert ar["ts"] == pytest.approx(0.05) and ar["dur"] == pytest.approx(0.1) and ar["args"]["nbytes"] == 64
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}


def test_gantt_figure():
    df = _frame()
    fig = timeline_figure(df, label="microbatch")
    assert {t.name for t in fig.data} == {"compute", "comm"}
    total = sum(len(t.x) for t in fig.data)
    assert total == len(df)
    comm = [t for t in fig.data if t.name == "comm"][0]
    assert sorted(comm.x.tolist()) == pytest.approx([60e-6, 100e-6])  # ms
    with pytest.raises(ValueError, match="'colour'"):
        timeline_figure(df, color_by="colour")
