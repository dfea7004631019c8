"""Per-rank timelines: what each rank did and when, as one pandas DataFrame.

A rank records events into a :class:`Timeline` (``ctx.timeline`` inside a launched function); ``launch``
ships them back and merges them into ``LaunchResult.timeline``. No torch import here.

Columns of a timeline frame (one row per event):

=============  ======  =====================================================================
column         type    meaning
=============  ======  =====================================================================
rank           int     global rank that recorded the event
name           str     what ran ("F", "all_reduce", "matmul", ...)
kind           str     ``compute`` | ``comm`` | ``idle`` | ``other``
start_ns       int     start on the run's common clock (ns); see below
end_ns         int     end on the run's common clock (ns), ``end_ns >= start_ns``
step           int     training step, or -1
microbatch     int     micro-batch index, or -1
stage          int     pipeline stage (or chunk), or -1
nbytes         int     bytes moved by a comm event (as the caller counts them), or 0
=============  ======  =====================================================================

The clock is ``time.monotonic_ns()`` (CLOCK_MONOTONIC), which is one clock for every process of a host.
Across hosts the launcher estimates each rank's offset to rank 0 (NTP-style ping-pong, Cristian 1989)
and subtracts it, so events from several nodes share rank 0's clock to within the round-trip time.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pandas is imported where frames are built, so a rank process need not load it
    import pandas as pd

KINDS = ("compute", "comm", "idle", "other")
COLUMNS = ["rank", "name", "kind", "start_ns", "end_ns", "step", "microbatch", "stage", "nbytes"]


#: Testing only: ns added to every reading of this process's timeline clock, so one host can play two hosts
#: whose clocks differ (tests/test_multinode.py checks that the offset estimate removes it). Unset in real runs.
_TEST_CLOCK_SKEW_NS = int(os.environ.get("LABKIT_TEST_CLOCK_SKEW_NS") or 0)


def now_ns() -> int:
    """The timeline clock: CLOCK_MONOTONIC in ns (shared by all processes of one host)."""
    return time.monotonic_ns() + _TEST_CLOCK_SKEW_NS


class Timeline:
    """Events recorded by one rank.

    ``rank`` is stored in every event. ``offset_ns`` (local clock minus rank 0's clock) is subtracted when
    the frame is built, so frames from several hosts line up.
    """

    def __init__(self, rank: int = 0, offset_ns: int = 0, sync=None):
        self.rank = int(rank)
        self.offset_ns = int(offset_ns)
        self.events: list[tuple] = []
        # called before reading the clock at the start and end of a span (e.g. torch.cuda.synchronize),
        # so asynchronous device work is inside the span it belongs to
        self._sync = sync

    def add(self, name: str, kind: str, start_ns: int, end_ns: int, *, step: int = -1,
            microbatch: int = -1, stage: int = -1, nbytes: int = 0) -> None:
        """Record one event. Raises ValueError for an unknown kind or end before start."""
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} is not valid; choose one of: {', '.join(KINDS)}")
        if end_ns < start_ns:
            raise ValueError(f"event {name!r}: end_ns={end_ns} is before start_ns={start_ns}")
        self.events.append((self.rank, str(name), kind, int(start_ns), int(end_ns), int(step),
                            int(microbatch), int(stage), int(nbytes)))

    @contextlib.contextmanager
    def span(self, name: str, kind: str = "compute", **tags) -> Iterator[None]:
        """Context manager recording the enclosed block as one event (tags: step, microbatch, stage,
        nbytes). The event is recorded even if the block raises."""
        if self._sync is not None:
            self._sync()
        start = now_ns()
        try:
            yield
        finally:
            if self._sync is not None:
                self._sync()
            self.add(name, kind, start, now_ns(), **tags)

    def __len__(self) -> int:
        return len(self.events)

    def to_frame(self) -> pd.DataFrame:
        """This rank's events as a DataFrame with :data:`COLUMNS`, on the run's common clock."""
        import pandas as pd
        df = pd.DataFrame(self.events, columns=COLUMNS)
        df = df.astype({c: "int64" for c in COLUMNS if c not in ("name", "kind")})
        if self.offset_ns:
            df["start_ns"] -= self.offset_ns
            df["end_ns"] -= self.offset_ns
        return df


def empty_frame() -> pd.DataFrame:
    return Timeline().to_frame()


def concat(frames: Iterable[pd.DataFrame]) -> pd.DataFrame:
    """Merge several ranks' frames into one, sorted by (start_ns, rank)."""
    import pandas as pd
    frames = [f for f in frames if f is not None and len(f)]
    if not frames:
        return empty_frame()
    df = pd.concat(frames, ignore_index=True)
    return df.sort_values(["start_ns", "rank"], kind="stable").reset_index(drop=True)


def relative(df: pd.DataFrame, origin_ns: int | None = None) -> pd.DataFrame:
    """Copy of ``df`` with ``start_s``, ``end_s``, ``dur_s`` (seconds) from ``origin_ns`` (default: the
    earliest start in the frame)."""
    out = df.copy()
    if origin_ns is None:
        origin_ns = int(out["start_ns"].min()) if len(out) else 0
    out["start_s"] = (out["start_ns"] - origin_ns) / 1e9
    out["end_s"] = (out["end_ns"] - origin_ns) / 1e9
    out["dur_s"] = (out["end_ns"] - out["start_ns"]) / 1e9
    return out


def _union_ns(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def _overlap_ns(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Total length of the intersection of two sorted, disjoint interval lists."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def busy_ns(df: pd.DataFrame, kinds: tuple[str, ...] = ("compute",)) -> pd.Series:
    """Per rank, the length (ns) of the union of events of the given kinds (overlaps counted once)."""
    import pandas as pd
    out = {}
    for rank, g in df.groupby("rank"):
        sel = g[g["kind"].isin(kinds)]
        out[rank] = sum(e - s for s, e in _union_ns(list(zip(sel["start_ns"], sel["end_ns"]))))
    return pd.Series(out, name="busy_ns", dtype="int64")


def exposed_ns(df: pd.DataFrame, kind: str = "comm", hidden_by: str = "compute") -> pd.DataFrame:
    """Per rank: total ``kind`` time, the part overlapped by ``hidden_by`` events, and the exposed rest.

    Exposed communication = communication time during which the rank computes nothing; the hidden fraction
    is overlapped / total (0 when there is no communication). Returns columns
    ``total_ns, hidden_ns, exposed_ns, hidden_fraction`` indexed by rank.
    """
    import pandas as pd
    rows = {}
    for rank, g in df.groupby("rank"):
        a = _union_ns(list(zip(g.loc[g["kind"] == kind, "start_ns"], g.loc[g["kind"] == kind, "end_ns"])))
        b = _union_ns(list(zip(g.loc[g["kind"] == hidden_by, "start_ns"],
                               g.loc[g["kind"] == hidden_by, "end_ns"])))
        total = sum(e - s for s, e in a)
        hidden = _overlap_ns(a, b)
        rows[rank] = {"total_ns": total, "hidden_ns": hidden, "exposed_ns": total - hidden,
                      "hidden_fraction": hidden / total if total else 0.0}
    return pd.DataFrame.from_dict(rows, orient="index").rename_axis("rank")


def to_chrome_trace(df: pd.DataFrame, path: str | Path | None = None) -> dict:
    """Chrome-trace / Perfetto JSON ("X" complete events, µs): one process per rank, one thread per kind.

    Open the written file in https://ui.perfetto.dev or chrome://tracing. Returns the trace dict; writes it
    to ``path`` when given.
    """
    origin = int(df["start_ns"].min()) if len(df) else 0
    tids = {k: i for i, k in enumerate(KINDS)}
    events = []
    for rank in sorted(df["rank"].unique()) if len(df) else []:
        events.append({"ph": "M", "name": "process_name", "pid": int(rank), "tid": 0,
                       "args": {"name": f"rank {int(rank)}"}})
        for k, t in tids.items():
            events.append({"ph": "M", "name": "thread_name", "pid": int(rank), "tid": t, "args": {"name": k}})
    for r in df.itertuples(index=False):
        args = {c: int(getattr(r, c)) for c in ("step", "microbatch", "stage", "nbytes") if getattr(r, c) >= 0}
        events.append({"ph": "X", "name": r.name, "cat": r.kind, "pid": int(r.rank), "tid": tids[r.kind],
                       "ts": (r.start_ns - origin) / 1e3, "dur": (r.end_ns - r.start_ns) / 1e3, "args": args})
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace
