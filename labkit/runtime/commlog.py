"""Communication log: count every collective a piece of code issues, with its bytes.

``with CommLog() as log:`` patches the ``torch.distributed`` collective functions for the duration of the
block; every call made as ``dist.<op>(...)`` (the lab's code always calls them that way) is recorded and
then executed unchanged. ``log.to_frame()`` gives one row per call.

Byte conventions (the same as nccl-tests, PERFORMANCE.md "Bus bandwidth"):

* ``nbytes`` — S, the buffer size nccl-tests reports: the input for all_reduce / broadcast / send / recv,
  the whole output (n x the local input) for all_gather, the whole input (n x the output) for
  reduce_scatter, the local input for all_to_all.
* ``bytes_per_rank`` — what one rank sends with the bandwidth-optimal (ring) algorithm:
  S x :func:`bus_factor` (all_reduce 2(n-1)/n, all_gather / reduce_scatter / all_to_all (n-1)/n,
  broadcast / send 1, recv 0). Source: Patarasuk & Yuan 2009 (ring all-reduce); nccl-tests PERFORMANCE.md.
"""

from __future__ import annotations

import contextlib

import pandas as pd
import torch.distributed as dist

from labkit.checks import positive_int
from labkit.parallel.comm import all_gather_tensor, nbytes, reduce_scatter_tensor  # noqa: F401 - wrappers re-exported
from labkit.runtime.timeline import now_ns
from labkit.theory import costmodel

#: the ops a CommLog records, by torch.distributed function name -> canonical op name
PATCHED = {
    "all_reduce": "all_reduce",
    "all_gather_single": "all_gather",  # torch >= 2.13 name of all_gather_into_tensor
    "all_gather_into_tensor": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_single": "reduce_scatter",  # torch >= 2.13 name of reduce_scatter_tensor
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "all_to_all": "all_to_all",
    "broadcast": "broadcast",
    "send": "send",
    "recv": "recv",
    "isend": "send",
    "irecv": "recv",
}
PATCHED = {k: v for k, v in PATCHED.items() if hasattr(dist, k)}
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "recv")


def bus_factor(op: str, n: int) -> float:
    """Bytes one rank sends per byte of S with the ring algorithm on n ranks: the nccl-tests busbw factor
    (:func:`labkit.theory.costmodel.bus_factor`: all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all
    (n-1)/n; broadcast 1), with a point-to-point pair split into its sides: send 1, recv 0.

    Raises ValueError for an unknown op or n < 1.
    """
    if op not in OPS:
        raise ValueError(f"op={op!r} is not valid; choose one of: {', '.join(OPS)}")
    if op == "recv":
        positive_int("n", n)
        return 0.0
    return costmodel.bus_factor("send_recv" if op == "send" else op, n)


def _group_size(kwargs) -> int:
    group = kwargs.get("group")
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


def _payload(name: str, args, kwargs) -> int:
    """S for one call, following the nccl-tests convention (module docstring)."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    if name in ("all_gather_into_tensor", "all_gather_single"):
        return nbytes(args[0] if args else kwargs["output_tensor"])
    if name == "all_gather":
        return nbytes(args[0] if args else kwargs["tensor_list"])
    if name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        return nbytes(args[1] if len(args) > 1 else kwargs["input"])
    if name == "reduce_scatter":
        return nbytes(args[1] if len(args) > 1 else kwargs["input_list"])
    if name in ("all_to_all_single",):
        return nbytes(args[1] if len(args) > 1 else kwargs["input"])
    if name == "all_to_all":
        return nbytes(args[1] if len(args) > 1 else kwargs["input_tensor_list"])
    return nbytes(first)


class CommLog:
    """Record collectives issued through ``torch.distributed`` while the context is active.

    Each record: ``op`` (canonical name), ``fn`` (the torch function called), ``nbytes`` (S), ``group_size``
    (n), ``bytes_per_rank`` (S x bus_factor), ``tag`` (the current :meth:`tagged` label), ``async_op``,
    ``start_ns``/``end_ns`` (call to return; for async calls only the issue time). With ``ctx`` given,
    synchronous calls are also added to ``ctx.timeline`` as ``comm`` events.
    Not re-entrant across threads; one CommLog active per process at a time.
    """

    def __init__(self, ctx=None):
        self.ctx = ctx
        self.records: list[dict] = []
        self._tag = ""
        self._saved: dict = {}

    @contextlib.contextmanager
    def tagged(self, tag: str):
        """Label the collectives issued inside the block (e.g. ``layer3.attn``)."""
        old, self._tag = self._tag, tag
        try:
            yield
        finally:
            self._tag = old

    def _wrap(self, name: str, fn):
        op = PATCHED[name]

        def wrapper(*args, **kwargs):
            n = _group_size(kwargs)
            s = _payload(name, args, kwargs)
            start = now_ns()
            out = fn(*args, **kwargs)
            end = now_ns()
            is_async = bool(kwargs.get("async_op")) or name in ("isend", "irecv")
            self.records.append({"op": op, "fn": name, "nbytes": s, "group_size": n,
                                 "bytes_per_rank": s * bus_factor(op, n), "tag": self._tag,
                                 "async_op": is_async, "start_ns": start, "end_ns": end})
            if self.ctx is not None and not is_async:
                self.ctx.timeline.add(op, "comm", start, end, nbytes=s)
            return out

        wrapper._labkit_commlog = self
        return wrapper

    def __enter__(self) -> CommLog:
        if any(hasattr(getattr(dist, n), "_labkit_commlog") for n in PATCHED):
            raise RuntimeError("another CommLog is already active in this process")
        for name in PATCHED:
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()

    def to_frame(self) -> pd.DataFrame:
        cols = ["op", "fn", "nbytes", "group_size", "bytes_per_rank", "tag", "async_op", "start_ns", "end_ns"]
        return pd.DataFrame(self.records, columns=cols)

    def summary(self) -> pd.DataFrame:
        """Calls and bytes per op: columns ``calls``, ``nbytes``, ``bytes_per_rank``."""
        df = self.to_frame()
        return df.groupby("op").agg(calls=("op", "size"), nbytes=("nbytes", "sum"),
                                    bytes_per_rank=("bytes_per_rank", "sum"))
