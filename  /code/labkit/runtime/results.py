"""How torchrun ranks store their results for :func:`labkit.runtime.launcher.load_results`: data, not code.

The trust boundary: an ``--out`` folder is often shared (a cluster file system, a colleague's run), and
unpickling a file runs whatever code its author put in it. So by default every rank writes
``rank<r>.pt`` with ``torch.save`` and the reader loads it with ``torch.load(weights_only=True)``, torch's
restricted unpickler: it rebuilds tensors, numbers, strings, bytes, None/bool, lists, tuples, dicts, sets
and NumPy scalars/arrays of plain dtypes (added by :data:`SAFE_NUMPY`), and refuses everything else without
running it. A rank whose result is not such data fails with a clear TypeError *before* writing anything —
unless the run opted in with ``--pickle-results``: then it writes ``rank<r>.pkl`` (cloudpickle: DataFrames,
your own classes) and the reader must say ``load_results(dir, allow_pickle=True)``, which it should only do
for folders it trusts. ``meta.json`` is JSON. :func:`labkit.launch` itself exchanges pickles only through
its private temporary folder (mode 0700, removed after the run): nothing there crosses a trust boundary.
"""

from __future__ import annotations

import io

SAFE_FORMAT = "torch-weights-only"
PICKLE_FORMAT = "pickle"


def _safe_globals() -> list:
    """NumPy reconstructors and plain dtypes (no object dtype) for ``torch.load(weights_only=True)``."""
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core
    out = [core.multiarray.scalar, core.multiarray._reconstruct, np.ndarray, np.dtype]
    for code in np.typecodes["All"]:
        if code != "O":
            out.append(type(np.dtype(code)))
    return out


SAFE_NUMPY = None  # filled on first use (numpy imported lazily)


def _load_safe(data: bytes):
    import torch
    from torch.serialization import safe_globals

    global SAFE_NUMPY
    if SAFE_NUMPY is None:
        SAFE_NUMPY = _safe_globals()
    with safe_globals(SAFE_NUMPY):
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def dumps_safe(obj) -> bytes:
    """``torch.save`` bytes of ``obj`` after checking that :func:`loads_safe` reads it back. Raises TypeError
    naming what is not plain data."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    try:
        _load_safe(data)
    except Exception as e:  # noqa: BLE001 - torch's UnpicklingError names the refused global
        msg = str(e)
        hint = next((ln.strip() for ln in msg.splitlines() if "GLOBAL" in ln or "Unsupported" in ln), msg[:200])
        raise TypeError(f"not plain data ({hint})") from None
    return data


def loads_safe(data: bytes):
    """Read :func:`dumps_safe` bytes without running code (``weights_only=True``)."""
    return _load_safe(data)
