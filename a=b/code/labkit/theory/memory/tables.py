"""Several predictions at once, as plain rows: every convention (:func:`convention_table`), several training
layouts (:func:`layout_rows`), several serving workloads (:func:`serving_rows`), and :func:`estimate`, the one
call behind the CLI and the widgets.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, replace

from labkit.checks import check_choice, positive_int
from labkit.theory.memory.budget import MemoryEstimate, _resolve_model
from labkit.theory.memory.config import InferConfig, ParallelConfig, TrainConfig
from labkit.theory.memory.conventions import CONVENTIONS, DEFAULT_HEADROOM, MODES
from labkit.theory.memory.infer import infer_memory
from labkit.theory.memory.params import _model_states
from labkit.theory.memory.train import train_memory


def convention_table(n_params: float, dp: int = 1, zero: int = 0, optimizer: str = "adamw") -> list[dict]:
    """Model-state bytes per rank of ``n_params`` parameters under every convention of :data:`CONVENTIONS`
    (rows: convention, bytes_per_param unsharded, parameters, gradients, optimizer, total bytes, source).
    Raises ValueError for n_params < 1, dp < 1, a zero stage outside 0..3 or an unknown optimizer."""
    if isinstance(n_params, bool) or not isinstance(n_params, (int, float)):
        raise ValueError(f"n_params={n_params!r} must be a parameter count (a number >= 1)")
    n_params = _resolve_model(n_params)
    check_choice("zero", zero, (0, 1, 2, 3))
    check_choice("optimizer", optimizer, ("adamw", "sgd"))
    rows = []
    for name, conv in CONVENTIONS.items():
        cats = _model_states([(None, (int(n_params),))], conv, optimizer, zero, positive_int("dp", dp), 1)
        rows.append({"convention": name, "bytes_per_param": conv.bytes_per_param(optimizer), **cats,
                     "total_bytes": sum(cats.values()), "source": conv.source})
    return rows


def estimate(mode: str = "train", **kwargs) -> MemoryEstimate:
    """One call for the CLI and widgets: ``mode`` ``train`` or ``infer``; ``model``; parallel fields (dp, tp, pp,
    cp, ep, zero, sequence_parallel, vpp, schedule, shard_layout); train or infer fields; ``device``,
    ``headroom``, ``workspace_bytes``, and for training ``bucket_bytes``, ``dp_rank``. Unknown keywords raise
    ValueError naming them."""
    check_choice("mode", mode, MODES)
    model = kwargs.pop("model")
    par_fields = {f for f in ParallelConfig.__dataclass_fields__}
    cfg_cls = TrainConfig if mode == "train" else InferConfig
    cfg_fields = set(cfg_cls.__dataclass_fields__)
    top = {"device", "headroom", "workspace_bytes"} | ({"bucket_bytes", "dp_rank"} if mode == "train" else set())
    unknown = set(kwargs) - par_fields - cfg_fields - top
    if unknown:
        valid = sorted(par_fields | cfg_fields | top)
        raise ValueError(f"unknown option(s) {', '.join(sorted(unknown))} for mode={mode!r}; valid: {', '.join(valid)}")
    parallel = ParallelConfig(**{k: v for k, v in kwargs.items() if k in par_fields})
    cfg = cfg_cls(**{k: v for k, v in kwargs.items() if k in cfg_fields})
    rest = {k: v for k, v in kwargs.items() if k in top}
    if mode == "train":
        return train_memory(model, parallel, cfg, **rest)
    return infer_memory(model, parallel, cfg, **rest)


def layout_rows(model, layouts: Iterable[dict], *, device: str | None = None, headroom: float = DEFAULT_HEADROOM,
                **train_kwargs) -> list[dict]:
    """Predicted training memory of ``model`` for several parallel layouts, one row each (plain dicts, bytes):
    the layout's fields (dp, tp, pp, zero, ...), ``world_size``, every category, ``total_bytes``, ``stage``
    and ``fits`` on ``device``. ``train_kwargs`` are TrainConfig fields shared by every row. A layout that does
    not divide the model raises ValueError naming it."""
    rows = []
    for lay in layouts:
        par = ParallelConfig(**lay)
        est = train_memory(model, par, TrainConfig(**train_kwargs), device=device, headroom=headroom)
        rows.append({**asdict(par), "world_size": par.world_size, **est.categories,
                     "total_bytes": est.total_bytes, "stage": est.stage, "fits": est.fits})
    return rows


def serving_rows(model, workloads: Iterable[dict], *, device: str | None = None, headroom: float = DEFAULT_HEADROOM,
                 **parallel_kwargs) -> list[dict]:
    """Predicted serving memory of ``model`` for several workloads (InferConfig fields: batch, prompt_len,
    output_len, weight_dtype, ...), one row each: the workload, every category (bytes), ``total_bytes``,
    ``fits`` on ``device``, and ``max_batch`` — the most concurrent sequences whose peak still fits (None
    without a device)."""
    par = ParallelConfig(**parallel_kwargs)
    rows = []
    for wl in workloads:
        cfg = InferConfig(**wl)
        est = infer_memory(model, par, cfg, device=device, headroom=headroom)
        row = {**wl, **est.categories, "total_bytes": est.total_bytes, "fits": est.fits, "max_batch": None}
        if est.device_bytes is not None:
            lo, hi = 0, 1
            while infer_memory(model, par, replace(cfg, batch=hi), device=device, headroom=headroom).fits:
                lo, hi = hi, hi * 2
                if hi > 1 << 20:
                    break
            while hi - lo > 1:  # largest batch that fits, by bisection
                mid = (lo + hi) // 2
                if infer_memory(model, par, replace(cfg, batch=mid), device=device, headroom=headroom).fits:
                    lo = mid
                else:
                    hi = mid
            row["max_batch"] = lo
        rows.append(row)
    return rows
