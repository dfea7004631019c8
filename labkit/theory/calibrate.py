"""Calibration and validation kept apart: which rows may fit a profile's free parameters, and the fitting.

Pure Python (no torch, no pandas, no yaml). A row is a dict (one line of a CSV in the published schema, or one
row of a ``labkit record`` recording) with a ``role`` column:

* ``calibration``: used to fit the free parameters;
* ``validation``: never used in fitting, only to report how far the fitted model lands from it.

:func:`split_roles` is the one gate: every fit in the lab reads :func:`calibration_rows` and nothing else, so a
validation row cannot influence a fit (tests/test_calibrate.py perturbs the validation rows and asserts the
fitted parameters do not move).
"""

from __future__ import annotations

import math

#: the roles a row may carry
ROLES = ("calibration", "validation")


def _row_name(row: dict, index: int) -> str:
    """A short name of a row for an error message: its source/op/bytes if it has them, else its index."""
    keys = ("source", "run", "op", "shape", "bytes", "model")
    parts = [f"{k}={row[k]!r}" for k in keys if row.get(k) not in (None, "")]
    return f"row {index} ({', '.join(parts)})" if parts else f"row {index}"


def split_roles(rows) -> tuple[list[dict], list[dict]]:
    """Split ``rows`` (an iterable of dicts) by their ``role`` column into ``(calibration, validation)``, each
    in the input order.

    Raises ValueError naming the first row whose ``role`` is missing, empty or not one of :data:`ROLES`
    (``'calibration'`` or ``'validation'``; surrounding spaces and case are ignored).
    """
    calibration: list[dict] = []
    validation: list[dict] = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"row {i} is {type(row).__name__} {row!r}; each row must be a dict with a 'role' column")
        role = str(row.get("role") or "").strip().lower()
        if role == "calibration":
            calibration.append(row)
        elif role == "validation":
            validation.append(row)
        else:
            raise ValueError(
                f"{_row_name(row, i)} has role={row.get('role')!r}; each row's role must be one of {ROLES}"
            )
    return calibration, validation


def calibration_rows(rows) -> list[dict]:
    """The rows whose ``role`` is ``calibration`` (the only rows a fit may read); raises ValueError as
    :func:`split_roles` does for a row without a valid role."""
    return split_roles(rows)[0]


def validation_rows(rows) -> list[dict]:
    """The rows whose ``role`` is ``validation`` (never fitted on); raises ValueError as :func:`split_roles`."""
    return split_roles(rows)[1]


# ------------------------------------------------------------------------------------------------------
# a recording's rows: which are calibration, which validation
# ------------------------------------------------------------------------------------------------------
#: the row kinds a profile's compute parameters are fitted on, and its link parameters
COMPUTE_KINDS = ("gemm", "memory")
PROGRAM_KINDS = ("trace",)
LINK_KINDS = ("collective",)


def _num(row: dict, key: str) -> float | None:
    v = row.get(key, "")
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def measured_rows(rows) -> list[dict]:
    """The rows that hold a measurement: ``seconds`` a finite number > 0 (a part that did not run has it empty)."""
    return [r for r in rows if (_num(r, "seconds") or 0) > 0]


def assign_roles(rows) -> list[dict]:
    """Copies of ``rows`` with a ``role``: a row that has a valid one keeps it; ``step`` rows (whole training
    steps) are always ``validation``; the others are split deterministically within each (kind, op, dtype)
    group, ordered by (bytes, flops, shape): the 1st, 3rd, 5th ... are ``calibration``, the 2nd, 4th ... are
    ``validation`` (alternate sizes: every validation row lies between two calibration rows, so validation
    checks interpolation, not the fit's own points). The result depends on the rows' values only, not their
    order. Raises ValueError for a row whose role is set but not one of :data:`ROLES`."""
    out = [dict(r) for r in rows]
    groups: dict[tuple, list[dict]] = {}
    for i, r in enumerate(out):
        role = str(r.get("role") or "").strip().lower()
        if role:
            if role not in ROLES:
                raise ValueError(f"{_row_name(r, i)} has role={r.get('role')!r}; each row's role must be one of "
                                 f"{ROLES} or empty (assigned)")
            r["role"] = role
        elif r.get("kind") == "step":
            r["role"] = "validation"
        else:
            groups.setdefault((r.get("kind", ""), r.get("op", ""), r.get("dtype", "")), []).append(r)
    for members in groups.values():
        members.sort(key=lambda r: (_num(r, "bytes") or 0, _num(r, "flops") or 0, str(r.get("shape", ""))))
        for j, r in enumerate(members):
            r["role"] = ROLES[j % 2]
    return out


# ------------------------------------------------------------------------------------------------------
# pricing a row with a profile
# ------------------------------------------------------------------------------------------------------
def gemm_shape(row: dict) -> tuple[int, int, int, int]:
    """(batch, m, n, k) of a gemm row's ``shape`` ``"m x n x k"`` (or ``"b x m x n x k"``). ValueError otherwise."""
    parts = str(row.get("shape", "")).lower().replace(" ", "").split("x")
    try:
        dims = [int(p) for p in parts]
    except ValueError:
        dims = []
    if len(dims) == 3:
        return (1, *dims)
    if len(dims) == 4:
        return tuple(dims)
    raise ValueError(f"gemm row shape={row.get('shape')!r} must be 'm x n x k' (e.g. '64x64x64')")


def price_row(cluster, row: dict) -> float:
    """Seconds the profile ``cluster`` charges for the operation of ``row`` — the emulator's own cost functions:

    * ``gemm``: :meth:`Cluster.kernel_s` ``("gemm", shape=(batch, m, n, k))`` where the profile has kernel
      parameters, else :meth:`Cluster.compute_s` of the row's flops and bytes (the roofline);
    * ``memory``: :meth:`Cluster.compute_s` of its flops and bytes;
    * ``trace`` (a traced training step, ``row["trace"]`` = ``[flops, nbytes, dtype, count]`` per distinct
      operation): the sum of :meth:`Cluster.compute_s` over its operations, as the emulator's replay charges a
      rank's compute (host time between operations costs nothing);
    * ``collective``: :meth:`Cluster.collective_s` of op and S on ranks 0..world_size-1 (``send_recv``:
      :meth:`Cluster.p2p_s` 0 -> 1).

    Raises ValueError for another kind."""
    kind, dtype = row.get("kind"), str(row.get("dtype") or "fp32")
    flops, nbytes = _num(row, "flops") or 0.0, _num(row, "bytes") or 0.0
    if kind == "gemm":
        if getattr(cluster, "kernels", None) is not None and hasattr(cluster, "kernel_s"):
            return cluster.kernel_s("gemm", flops=flops, nbytes=nbytes, dtype=dtype, shape=gemm_shape(row))
        return cluster.compute_s(flops, nbytes, dtype)
    if kind == "memory":
        return cluster.compute_s(flops, nbytes, dtype)
    if kind == "trace":
        ops = row.get("trace")
        if not ops:
            raise ValueError(f"trace row {row.get('shape')!r} has no traced operations (traces.json)")
        return sum(n * cluster.compute_s(f, b, d) for f, b, d, n in ops)
    if kind == "collective":
        n = int(_num(row, "world_size") or 2)
        if row.get("op") == "send_recv":
            return cluster.p2p_s(0, 1, nbytes)
        return cluster.collective_s(str(row.get("op")), nbytes, tuple(range(n)))
    raise ValueError(f"row kind={kind!r} cannot be priced; valid: gemm, memory, trace, collective")


def residuals(cluster, rows) -> list[dict]:
    """Per row: kind, op, shape, dtype, bytes, role, ``measured_s``, ``fit_s`` (:func:`price_row`) and
    ``ratio`` = fit / measured."""
    out = []
    for r in rows:
        t, p = _num(r, "seconds"), price_row(cluster, r)
        out.append({k: r.get(k, "") for k in ("kind", "op", "shape", "dtype", "bytes", "role")}
                   | {"measured_s": t, "fit_s": p, "ratio": p / t})
    return out


def summarize(res: list[dict]) -> dict:
    """``rows``, ``median_abs_error`` and ``max_abs_error`` (|fit/measured - 1|, fractions) of residual rows."""
    errs = sorted(abs(r["ratio"] - 1) for r in res)
    if not errs:
        return {"rows": 0, "median_abs_error": None, "max_abs_error": None}
    mid = len(errs) // 2
    med = errs[mid] if len(errs) % 2 else (errs[mid - 1] + errs[mid]) / 2
    return {"rows": len(errs), "median_abs_error": med, "max_abs_error": errs[-1]}


# ------------------------------------------------------------------------------------------------------
# fitting
# ------------------------------------------------------------------------------------------------------
def nelder_mead(f, x0, *, step: float = 0.5, iters: int = 400, tol: float = 1e-10) -> list[float]:
    """Minimise ``f`` (a function of a list of floats) from ``x0``: the Nelder-Mead simplex (Nelder & Mead 1965,
    Computer Journal 7(4); the standard coefficients 1, 2, 0.5, 0.5). Deterministic; pure Python."""
    n = len(x0)
    pts = [list(x0)] + [[x + (step if i == j else 0.0) for j, x in enumerate(x0)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=lambda i: vals[i])
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if abs(vals[-1] - vals[0]) <= tol * (1 + abs(vals[0])):
            break
        c = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        xr = [c[j] + (c[j] - pts[-1][j]) for j in range(n)]
        fr = f(xr)
        if fr < vals[0]:
            xe = [c[j] + 2 * (c[j] - pts[-1][j]) for j in range(n)]
            fe = f(xe)
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = [c[j] + 0.5 * (pts[-1][j] - c[j]) for j in range(n)]
            fc = f(xc)
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:
                pts = [pts[0]] + [[pts[0][j] + 0.5 * (p[j] - pts[0][j]) for j in range(n)] for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    best = min(range(n + 1), key=lambda i: vals[i])
    return pts[best]


def fit(build, names, x0, rows, *, lower=None, upper=None) -> dict:
    """Fit parameters ``names`` (starting at ``x0``, all > 0) so that ``build(values) -> Cluster`` prices
    ``rows`` (:func:`price_row`) closest to their measured seconds: minimise ``sum(log(fit / measured)^2)``
    over the parameters' logarithms (relative errors: a microsecond and a second count alike), each clamped
    to [``lower``, ``upper``]. Returns ``{name: value}``. Raises ValueError when ``rows`` is empty."""
    rows = list(rows)
    if not rows:
        raise ValueError(f"no calibration rows to fit {', '.join(names)} on")
    lo = [math.log(v) for v in (lower or [1e-30] * len(names))]
    hi = [math.log(v) for v in (upper or [1e30] * len(names))]
    meas = [math.log(_num(r, "seconds")) for r in rows]

    def values(u):
        return [math.exp(min(max(x, a), b)) for x, a, b in zip(u, lo, hi)]

    def loss(u):
        try:
            cl = build(values(u))
            return sum((math.log(price_row(cl, r)) - m) ** 2 for r, m in zip(rows, meas))
        except (ValueError, ZeroDivisionError, OverflowError):
            return math.inf

    u = [math.log(v) for v in x0]
    for _ in range(3):  # restarts: Nelder-Mead can stall on a flat ridge
        u = nelder_mead(loss, u)
    return dict(zip(names, values(u)))


# ------------------------------------------------------------------------------------------------------
# a profile fitted on a recording
# ------------------------------------------------------------------------------------------------------
FORMAT = "labkit-profile/1"
#: (fitted parameter, unit, what it is) of a profile fitted on a recording without a datasheet device
PARAMETERS = {
    "peak_tflops": ("TFLOP/s", "sustained GEMM rate per rank (the profile's peak; compute_efficiency = 1)"),
    "memory_gbps": ("GB/s", "streaming-kernel bandwidth per rank (memory_efficiency = 1)"),
    "kernel_overhead_s": ("s", "seconds every operation costs besides its work (call, dispatch, launch)"),
    "gemm_k_half": ("elements", "K at which a GEMM runs at half its rate (labkit.theory.kernels.gemm_s)"),
    "link_gbps": ("GB/s", "the ranks' link, per direction (the ring's bandwidth)"),
    "hop_latency_s": ("s", "one ring step's latency on the link"),
    "base_latency_s": ("s", "fixed seconds of every collective call"),
}


def _has_kernels() -> bool:
    from dataclasses import fields

    from labkit.theory.cluster import Cluster

    return any(f.name == "kernels" for f in fields(Cluster))


def build_cluster(name: str, world_size: int, values: dict, *, device: str = "", dtypes=("fp32",)):
    """The :class:`~labkit.theory.cluster.Cluster` of a machine recorded at ``world_size`` ranks, from parameter
    ``values`` (:data:`PARAMETERS`; missing ones at neutral defaults): one node of ``world_size`` ranks, a
    device ``<name>-device`` whose fp32 peak is ``peak_tflops`` (another dtype's ``peak_tflops_<dtype>``, default
    the fp32 one) and whose memory bandwidth
    is ``memory_gbps``, a link ``<name>-link``; every efficiency 1 (the fitted rates are what the machine
    sustains, not a datasheet's peak), GEMM tiles of 1 x 1 on one "SM" (a CPU rank: no tile or wave
    quantisation)."""
    from labkit.theory import costmodel
    from labkit.theory.cluster import Cluster, Device

    v = {"peak_tflops": 0.05, "memory_gbps": 10.0, "kernel_overhead_s": 0.0, "gemm_k_half": 0.0,
         "link_gbps": 1.0, "hop_latency_s": 0.0, "base_latency_s": 0.0, **values}
    peaks = {dt: v.get(f"peak_tflops_{dt}", v["peak_tflops"]) for dt in {"fp32", *dtypes}}
    dev = Device(f"{name}-device", peaks, v["memory_gbps"],
                 source=f"fit (labkit calibrate); {device}".rstrip("; "))
    link = costmodel.Link(f"{name}-link", v["link_gbps"], 2 * v["link_gbps"], v["hop_latency_s"], v["hop_latency_s"],
                          "the recorded ranks' link", "fit (labkit calibrate)", "fit (labkit calibrate)")
    kw = {}
    if _has_kernels():
        from labkit.theory.kernels import KernelParams

        kw["kernels"] = KernelParams(gemm_efficiency=1.0, gemm_k_half=v["gemm_k_half"], attention_efficiency=1.0,
                                     memory_efficiency=1.0, launch_s=0.0, sm_count=1, tiles=((1, 1),),
                                     source="fit (labkit calibrate): gemm_k_half; launch cost in kernel_overhead_s")
    return Cluster(dev, world_size, link, None, name=name, compute_efficiency=1.0, memory_efficiency=1.0,
                   link_efficiency=1.0, kernel_overhead_s=v["kernel_overhead_s"], base_latency_s=v["base_latency_s"],
                   description=f"{name}: fitted by labkit calibrate on a recording of {device or 'a machine'}",
                   source="fit (labkit calibrate)", **kw)


def _start(rows, kind, fn, default):
    vals = [fn(r) for r in rows if r.get("kind") == kind]
    vals = [x for x in vals if x and math.isfinite(x) and x > 0]
    return max(vals) if vals else default


def calibrate_rows(rows, *, name: str, identity: dict | None = None) -> dict:
    """Fit a profile named ``name`` on a recording's ``rows`` (``labkit record``'s recording.csv as dicts).

    Roles: :func:`assign_roles` (rows with a role keep it; the rest alternate by size); only
    :func:`calibration_rows` reach a fit. Two fits, each :func:`fit` (least squares of log time) through the
    emulator's own pricing (:func:`price_row`):

    * compute, on the calibration ``gemm`` and ``memory`` rows: ``peak_tflops``, ``memory_gbps``,
      ``kernel_overhead_s`` (and ``gemm_k_half`` where the cluster has kernel parameters); then, where the
      recording has calibration ``trace`` rows (whole traced training steps of a one-rank model), ``peak_tflops``
      and ``kernel_overhead_s`` again on those (the bandwidth kept): a kernel's tight loop pays less per
      operation than a training step does (autograd, module calls), and the emulator charges a step's
      operations, so the profile keeps the step's values; the kernel sweep's own are ``kernel_sweep_fit``;
    * link, on the calibration ``collective`` rows: ``link_gbps``, ``hop_latency_s``, ``base_latency_s``;

    plus, per collective op, Hockney's ``t = alpha + S / algbw`` on its calibration rows
    (:func:`labkit.theory.costmodel.fit_alpha_beta`; reported, busbw = algbw x the op's bus factor).

    Returns the profile (plain data, JSON-able): ``format``, ``name``, ``label``, ``cluster``
    (:meth:`Cluster.to_dict`), ``parameters`` (value, unit, source: ``fit`` on which rows), ``per_op``,
    ``residuals`` and ``summary`` for calibration and validation rows (``ratio`` = fit / measured), ``identity``.
    Raises ValueError when there are no calibration rows of a kind a fit needs, or a row's role is invalid.
    """
    from labkit.theory import costmodel

    rows = assign_roles(measured_rows(rows))
    calib, valid = split_roles(rows)
    ws = int(max([_num(r, "world_size") or 1 for r in rows] or [1]))
    dtypes = sorted({str(r.get("dtype") or "fp32") for r in rows if r.get("kind") == "gemm"}) or ["fp32"]
    device = str((identity or {}).get("device") or next((r.get("device") for r in rows if r.get("device")), ""))
    comp = [r for r in calib if r.get("kind") in COMPUTE_KINDS]
    link = [r for r in calib if r.get("kind") in LINK_KINDS]
    if not any(r.get("kind") == "gemm" for r in comp) or not any(r.get("kind") == "memory" for r in comp):
        raise ValueError("the recording needs calibration rows of kind 'gemm' and 'memory' (labkit record "
                         f"--only gemm,memory); it has kinds {sorted({r.get('kind') for r in rows})}")
    names = ["peak_tflops", "memory_gbps", "kernel_overhead_s"] + (["gemm_k_half"] if _has_kernels() else [])
    x0 = [_start(comp, "gemm", lambda r: _num(r, "flops") / _num(r, "seconds") / 1e12, 0.05),
          _start(comp, "memory", lambda r: _num(r, "bytes") / _num(r, "seconds") / 1e9, 10.0),
          min(_num(r, "seconds") for r in comp) / 2, 16.0][:len(names)]
    lower, upper = [1e-6, 1e-3, 1e-9, 1e-3][:len(names)], [1e4, 1e5, 1.0, 1e5][:len(names)]
    for dt in (d for d in dtypes if d != "fp32"):  # a GPU's other dtypes: a peak each
        names.append(f"peak_tflops_{dt}")
        x0.append(_start([r for r in comp if r.get("dtype") == dt], "gemm",
                         lambda r: _num(r, "flops") / _num(r, "seconds") / 1e12, x0[0]))
        lower, upper = [*lower, 1e-6], [*upper, 1e4]
    values = fit(lambda u: build_cluster(name, ws, dict(zip(names, u)), device=device, dtypes=dtypes),
                 names, x0, comp, lower=lower, upper=upper)
    sources = {n: f"fit on {len(comp)} calibration rows (gemm, memory)" for n in names}
    kernel_sweep = dict(values)
    prog = [r for r in calib if r.get("kind") in PROGRAM_KINDS]
    if prog:  # the rate and per-operation cost a whole training step sustains, the bandwidth kept
        pnames = ["peak_tflops", "kernel_overhead_s"]
        values |= fit(lambda u: build_cluster(name, ws, {**values, **dict(zip(pnames, u))}, device=device,
                                              dtypes=dtypes), pnames, [values[n] for n in pnames], prog,
                      lower=[1e-6, 1e-9], upper=[1e4, 1.0])
        sources |= {n: f"fit on {len(prog)} calibration rows (trace: traced training steps)" for n in pnames}
    per_op = {}
    if ws > 1 and link:
        lnames = ["link_gbps", "hop_latency_s", "base_latency_s"]
        lx0 = [_start(link, "collective", lambda r: _num(r, "bytes") / _num(r, "seconds") / 1e9, 1.0),
               min(_num(r, "seconds") for r in link) / 4, min(_num(r, "seconds") for r in link) / 4]
        values |= fit(lambda u: build_cluster(name, ws, {**values, **dict(zip(lnames, u))}, device=device,
                                              dtypes=dtypes), lnames, lx0, link,
                      lower=[1e-4, 1e-9, 1e-9], upper=[1e4, 1.0, 1.0])
        sources |= {n: f"fit on {len(link)} calibration rows (collective)" for n in lnames}
        for op in sorted({r.get("op") for r in link}):
            pts = [r for r in link if r.get("op") == op]
            if len({_num(r, "bytes") for r in pts}) >= 2:
                ab = costmodel.fit_alpha_beta([_num(r, "bytes") for r in pts], [_num(r, "seconds") for r in pts])
                f = costmodel.bus_factor(op, ws) if op != "send_recv" else 1.0
                per_op[op] = {"alpha_s": ab.alpha_s, "algbw_gbps": ab.bandwidth_gbps,
                              "busbw_gbps": ab.bandwidth_gbps * f, "rows": len(pts),
                              "source": f"fit (Hockney alpha-beta) on {len(pts)} calibration rows ({op})"}
    cluster = build_cluster(name, ws, values, device=device, dtypes=dtypes)
    res_c, res_v = residuals(cluster, [r for r in calib if r.get("kind") != "step"]), \
        residuals(cluster, [r for r in valid if r.get("kind") != "step"])
    sweep_cluster = build_cluster(name, ws, {**values, **kernel_sweep}, device=device, dtypes=dtypes)
    kernel_fit = {"parameters": kernel_sweep, "source": f"fit on {len(comp)} calibration rows (gemm, memory)",
                  "summary": {role: summarize(residuals(sweep_cluster, [r for r in rs if r.get("kind") in
                                                                         COMPUTE_KINDS + PROGRAM_KINDS]))
                              for role, rs in (("calibration", calib), ("validation", valid))}}
    return {
        "format": FORMAT, "name": name, "label": f"fit (labkit calibrate on measured ({device or name}))",
        "cluster": cluster.to_dict(),
        "parameters": {n: {"value": values[n], "unit": PARAMETERS[n.split("_tflops_")[0] + "_tflops"
                                                                if "_tflops_" in n else n][0],
                           "what": PARAMETERS["peak_tflops"][1].replace("GEMM rate", f"{n[12:]} GEMM rate")
                           if "_tflops_" in n else PARAMETERS[n][1], "source": sources[n]} for n in values},
        "per_op": per_op,
        "kernel_sweep_fit": kernel_fit,
        "residuals": {"calibration": res_c, "validation": res_v},
        "summary": {"calibration": summarize(res_c), "validation": summarize(res_v)},
        "identity": dict(identity or {}),
    }


# ------------------------------------------------------------------------------------------------------
# fitted profiles on disk, found by name
# ------------------------------------------------------------------------------------------------------
def profiles_dirs() -> list:
    """Where fitted profiles are looked up by name, in order: every folder of ``$LABKIT_PROFILES``
    (os.pathsep-separated), then ``<runs>/profiles`` (:func:`labkit.paths.runs_dir`)."""
    import os
    from pathlib import Path

    from labkit.paths import runs_dir

    env = [Path(p) for p in os.environ.get("LABKIT_PROFILES", "").split(os.pathsep) if p]
    return [*env, runs_dir() / "profiles"]


def profile_path(name: str):
    """The file of fitted profile ``name`` (``<dir>/<name>.json``, first of :func:`profiles_dirs`), or None."""
    for d in profiles_dirs():
        p = d / f"{name}.json"
        if p.is_file():
            return p
    return None


def fitted_names() -> list[str]:
    """The names of every fitted profile found in :func:`profiles_dirs`."""
    names = set()
    for d in profiles_dirs():
        if d.is_dir():
            names |= {p.stem for p in d.glob("*.json")}
    return sorted(names)


def save_profile(profile: dict, path=None):
    """Write ``profile`` as JSON to ``path`` (default ``<runs>/profiles/<name>.json``); returns the path."""
    import json
    from pathlib import Path

    from labkit.paths import runs_dir

    path = Path(path) if path else runs_dir() / "profiles" / f"{profile['name']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=2) + "\n", encoding="utf-8")
    return path


def load_profile(name_or_path) -> dict:
    """A fitted profile by name (:func:`profile_path`) or file path. Raises ValueError when there is none, or
    the file is not a profile (naming what was found)."""
    import json
    from pathlib import Path

    p = Path(str(name_or_path))
    path = p if p.suffix == ".json" and p.is_file() else profile_path(str(name_or_path))
    if path is None:
        raise ValueError(f"no fitted profile {name_or_path!r} in {', '.join(map(str, profiles_dirs()))} "
                         f"(found: {', '.join(fitted_names()) or 'none'}); write one with labkit calibrate")
    d = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(d, dict) or d.get("format") != FORMAT or "cluster" not in d:
        raise ValueError(f"{path} is not a fitted profile (format {FORMAT!r} with a 'cluster')")
    return d


def fitted_cluster(name: str):
    """The :class:`~labkit.theory.cluster.Cluster` of fitted profile ``name``, or None when there is none."""
    from labkit.theory.cluster import Cluster

    if profile_path(name) is None:
        return None
    return Cluster.from_dict(load_profile(name)["cluster"])


def scaled_compute(cluster, factor: float):
    """``cluster`` with compute ``factor`` times faster (every peak and the memory bandwidth x factor, the
    per-operation overhead / factor), links unchanged: the wrong profile a mutation test must catch."""
    from labkit.theory.cluster import Device

    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"factor={factor!r} must be a finite number > 0")
    d = cluster.device
    dev = Device(d.name, {k: v * factor for k, v in d.peak_tflops.items()}, d.memory_gbps * factor, d.memory_bytes,
                 d.source)
    return cluster.replace(device=dev, kernel_overhead_s=cluster.kernel_overhead_s / factor,
                           name=f"{cluster.name}-compute-x{factor:g}")
