"""CommLog: every collective recorded with nccl-tests byte conventions; torch functions restored after."""

import pytest
import torch
import torch.distributed as dist

from labkit import launch
from labkit.runtime.commlog import CommLog, all_gather_tensor, bus_factor, reduce_scatter_tensor


def logged(ctx):
    n = ctx.world_size
    with CommLog(ctx) as log:
        t = torch.ones(100)  # 400 bytes
        with log.tagged("layer0"):
            dist.all_reduce(t)
            all_gather_tensor(torch.empty(100 * n), t)
        reduce_scatter_tensor(torch.empty(100), torch.ones(100 * n))
        dist.all_to_all_single(torch.empty(4 * n), torch.ones(4 * n))
        dist.broadcast(t, src=0)
        peer = (ctx.rank + 1) % n
        reqs = [dist.isend(torch.ones(10), peer), dist.irecv(torch.empty(10), (ctx.rank - 1) % n)]
        for w in reqs:
            w.wait()
        try:
            with CommLog():
                pass
            nested = "no error"
        except RuntimeError as e:
            nested = str(e)
    restored = not hasattr(dist.all_reduce, "_labkit_commlog")
    return {"frame": log.to_frame(), "summary": log.summary(), "nested": nested, "restored": restored,
            "timeline_comm": int((ctx.timeline.to_frame()["kind"] == "comm").sum())}


@pytest.mark.parametrize("world_size", [2])
def test_commlog_counts_and_bytes(world_size):
    n = world_size
    res = launch(logged, n, echo=False)
    for r in res:
        df = r["frame"]
        by = df.set_index("op")
        assert list(df["op"]) == ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send",
                                  "recv"]
        assert by.loc["all_reduce", "nbytes"] == 400 and by.loc["all_reduce", "bytes_per_rank"] == 400 * 2 * (n - 1) / n
        assert by.loc["all_gather", "nbytes"] == 400 * n  # S = the whole gathered buffer
        assert by.loc["reduce_scatter", "nbytes"] == 400 * n  # S = the whole input
        assert by.loc["all_to_all", "nbytes"] == 16 * n
        assert by.loc["send", "bytes_per_rank"] == 40 and by.loc["recv", "bytes_per_rank"] == 0
        assert list(df["tag"][:2]) == ["layer0", "layer0"] and df["tag"][2] == ""
        assert df["async_op"].tolist() == [False] * 5 + [True] * 2
        assert (df["group_size"] == n).all()
        assert r["summary"].loc["all_reduce", "calls"] == 1
        assert "already active" in r["nested"] and r["restored"]
        assert r["timeline_comm"] == 5  # synchronous calls become comm events


def test_bus_factor_values_and_errors():
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_gather", 4) == 0.75
    assert bus_factor("send", 4) == 1.0 and bus_factor("recv", 4) == 0.0
    with pytest.raises(ValueError, match="op='gather'"):
        bus_factor("gather", 2)
