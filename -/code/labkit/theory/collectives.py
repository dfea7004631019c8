"""Collective sizes, op names and sweep plans, checked before anything is launched (pure Python, no torch).

Sizes follow nccl-tests: ``bytes`` is S, the whole buffer (all_gather: the gathered output; reduce_scatter:
the full input; all_to_all: the whole send buffer); ``count`` = S / element size. Suffixes K, M, G are powers
of 1024. The collectives' time formulas (bus factors, alpha-beta, ring vs tree) are in
:mod:`labkit.theory.costmodel`; the bytes a ring moves per rank, which the experiments of
:mod:`labkit.experiments.collective_patterns` set beside what they measure, are here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from labkit.checks import check_choice, positive_int
from labkit.theory.costmodel import OPS, SPLIT_OPS, check_world_size

#: dtype name -> bytes per element
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str | int, name: str = "size") -> int:
    """``"64M"`` -> 67108864. Suffixes K, M, G (also KB/KiB...) are powers of 1024, as in nccl-tests.

    Raises ValueError (naming ``name``) for anything else or a size < 1."""
    if isinstance(text, int) and not isinstance(text, bool):
        return positive_int(name, text)
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"{name}={text!r} is not a size; write bytes with an optional K, M or G suffix "
                         "(powers of 1024), e.g. 1024, 4K, 64M, 1G")
    return positive_int(name, int(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(nbytes: int) -> str:
    """1024 -> ``'1K'``, 67108864 -> ``'64M'`` (powers of 1024), else the plain number of bytes."""
    for suffix, unit in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def parse_ops(text: str | Iterable[str]) -> list[str]:
    """``"all_reduce,all_gather"`` or a list -> validated op names (``"all"`` = every op). ValueError names
    the valid ops."""
    items = [t.strip() for t in (text.split(",") if isinstance(text, str) else text) if str(t).strip()]
    if items == ["all"]:
        return list(OPS)
    if not items:
        raise ValueError(f"ops={text!r} is empty; choose from: {', '.join(OPS)}")
    for op in items:
        check_choice("op", op, OPS)
    return items


def element_size(dtype: str) -> int:
    """Bytes per element of a sweep dtype. ValueError names the valid dtypes."""
    check_choice("dtype", dtype, DTYPES)
    return DTYPES[dtype]


def check_size(op: str, nbytes: int, world_size: int, dtype: str = "float32") -> int:
    """Validate one (op, S) pair; return ``count`` (elements). Raises ValueError when the op is unknown,
    S < 1, S is not whole elements, the world is too small for the op, or S is not divisible as the op
    requires (all_gather, reduce_scatter, all_to_all split S into ``world_size`` equal chunks)."""
    check_choice("op", op, OPS)
    nbytes = positive_int("bytes", nbytes)
    n = check_world_size(op, world_size)
    esize = element_size(dtype)
    if nbytes % esize:
        raise ValueError(f"bytes={nbytes} is not a whole number of {dtype} elements ({esize} bytes each); "
                         f"use a multiple of {esize}")
    count = nbytes // esize
    if op in SPLIT_OPS and count % n:
        raise ValueError(f"{op} splits its buffer into world_size={n} equal chunks, but bytes={nbytes} is "
                         f"{count} {dtype} elements, not divisible by {n}; use a multiple of {n * esize} "
                         "bytes")
    return count


def size_range(min_size: int | str, max_size: int | str, factor: int = 2) -> list[int]:
    """Sizes ``min, min*factor, ...`` up to ``max`` (bytes), like nccl-tests ``-b/-e/-f``. ValueError when
    min > max, a size < 1 or factor < 2."""
    lo, hi = parse_size(min_size, "min_size"), parse_size(max_size, "max_size")
    factor = positive_int("factor", factor, minimum=2)
    if lo > hi:
        raise ValueError(f"min_size={lo} is larger than max_size={hi}; give min_size <= max_size")
    out = [lo]
    while out[-1] * factor <= hi:
        out.append(out[-1] * factor)
    return out


def align_size(op: str, nbytes: int, world_size: int, dtype: str = "float32") -> int:
    """Round S down to the nearest size ``op`` accepts (whole elements, a multiple of ``world_size`` elements
    for the split ops), at least one valid size; what nccl-tests does with ``-b/-e`` sizes."""
    esize = element_size(dtype)
    unit = esize * (world_size if op in SPLIT_OPS else 1)
    return max(unit, nbytes // unit * unit)


def plan(ops: Sequence[str], sizes: Sequence[int], world_size: int, dtype: str = "float32",
         *, align: bool = False) -> list[tuple[str, int, int]]:
    """The (op, bytes, count) cases of a sweep, validated before anything is launched.

    ``align=True`` rounds each size down to one the op accepts (for generated ranges); with ``align=False``
    a size the op cannot take raises ValueError (for sizes the user typed)."""
    ops = parse_ops(ops)
    if not sizes:
        raise ValueError("sizes is empty; give at least one size in bytes")
    cases = []
    for op in ops:
        seen = set()
        for s in sizes:
            s = parse_size(s)
            if align:
                s = align_size(op, s, world_size, dtype)
            if s in seen:
                continue
            seen.add(s)
            cases.append((op, s, check_size(op, s, world_size, dtype)))
    return cases


# ------------------------------------------------------------------------------------------------------
# bytes a ring moves per rank (Thakur, Rabenseifner & Gropp 2005, sec. 4; nccl-tests doc/PERFORMANCE.md)
# ------------------------------------------------------------------------------------------------------
def ar_vs_rs_ag_bytes(nbytes: int, world_size: int) -> dict[str, float]:
    """*Predicted* bytes each rank sends in a ring, per way of all-reducing S = ``nbytes``: ``all_reduce``
    2(n-1)/n S; ``reduce_scatter + all_gather`` (n-1)/n S + (n-1)/n S, the same; ``reduce_scatter`` and
    ``all_gather`` (n-1)/n S each."""
    f = (world_size - 1) / world_size
    return {"all_reduce": 2 * f * nbytes, "reduce_scatter + all_gather": 2 * f * nbytes,
            "reduce_scatter": f * nbytes, "all_gather": f * nbytes}


def repartition_bytes_per_rank(nbytes: int, world_size: int) -> dict[str, float]:
    """*Predicted* bytes each rank sends to re-partition an activation of M = ``nbytes`` in total with an
    all-to-all of its M/n shard, (n-1)/n * M/n, vs to reduce-scatter an M-byte partial sum in a ring,
    (n-1)/n * M: a ratio of n (8x at TP8)."""
    f = (world_size - 1) / world_size
    return {"all_to_all": f * nbytes / world_size, "reduce_scatter": f * nbytes}
