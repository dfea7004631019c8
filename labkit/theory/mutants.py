"""Wrong models the training validation must reject (issue 26, item 3: "a zero-overhead model and a
constant-efficiency model must each fail validation").

Pure Python. Each mutant is refitted on the calibration rows exactly as the real model is (its free parameter
chosen to match them best), then scored on the validation rows with :func:`labkit.theory.published.
training_goals`' MFU goals. A check that passes a mutant cannot tell a right model from a wrong one.

* ``no_communication``: every collective and send free (:func:`labkit.theory.steptime.mutation`), the sustained
  fraction per GPU refitted (:func:`labkit.theory.published.fit_sustained`);
* ``constant_efficiency``: every op at one fraction of peak (the planner's ``mfu=`` model: what the lab had
  before the kernel model), that fraction fitted on the calibration rows (grid 0.30-0.90).
"""

from __future__ import annotations

import math

from labkit.theory import published as pub
from labkit.theory import steptime


def _mfu_goals(rows) -> tuple[bool, str]:
    goals = pub.training_goals(rows)[:2]  # the MFU tolerance and the spread of the ratios
    return all(g["met"] for g in goals), "; ".join(f"{g['goal']}: {g['detail']}" for g in goals)


def _per_gpu_rows(fit: dict, path, **kw) -> list[dict]:
    out = []
    for gpu, f in fit.items():
        out += [r for r in pub.validate_published(path=path, sustained=f, rank=False, **kw)
                if not r.get("skipped") and r.get("gpu") == gpu]
    return out


def no_communication(path=None) -> dict:
    """The zero-communication mutant: refit, then the validation rows' MFU goals. Returns ``passes`` (both MFU
    goals met), ``fit`` and ``detail``."""
    with steptime.mutation(no_comm=True):
        fit = pub.fit_sustained(path=path)["value"]
        rows = _per_gpu_rows(fit, path)
    ok, detail = _mfu_goals(rows)
    return {"passes": ok, "fit": fit, "detail": detail}


def constant_efficiency(path=None, grid=None) -> dict:
    """The constant-efficiency mutant: the one fraction of peak (``grid``, default 0.30-0.90 by 0.01) that best
    fits the calibration rows (least squares of log ratios), then the validation rows' MFU goals."""
    grid = grid or [round(0.30 + 0.01 * i, 2) for i in range(61)]
    best = None
    for c in grid:
        cal = [r for r in pub.validate_published(path=path, mfu=c, rank=False, roles=("calibration",))
               if r.get("ratio")]
        loss = sum(math.log(r["ratio"]) ** 2 for r in cal)
        if cal and (best is None or loss < best[0]):
            best = (loss, c)
    c = best[1]
    rows = [r for r in pub.validate_published(path=path, mfu=c, rank=False) if not r.get("skipped")]
    ok, detail = _mfu_goals(rows)
    return {"passes": ok, "fit": {"mfu": c}, "detail": detail}


def real_model(path=None) -> dict:
    """The companion: the real model through the same check (it must pass where the mutants fail)."""
    rows = [r for r in pub.validate_published(path=path, rank=False) if not r.get("skipped")]
    ok, detail = _mfu_goals(rows)
    return {"passes": ok, "fit": pub.fit_sustained(path=path)["value"], "detail": detail}


def mutant_goals(path=None) -> dict:
    """Each mutant's result (:func:`no_communication`, :func:`constant_efficiency`), by name."""
    return {"no_communication": no_communication(path), "constant_efficiency": constant_efficiency(path)}
