"""Run records: what ran, where, with which versions, and what it measured — one folder per run.

A record folder (``runs/records/<UTC stamp>_<experiment>_<id>/``) holds

* ``identity.json`` — experiment, parameters, git sha (and whether the tree was dirty), labkit, torch and
  Python versions, backend, world size, host, CPU cores or GPU names, start time (UTC, ISO 8601);
* ``metrics.csv`` — the measured numbers (one row per measurement), when given;
* ``timeline.csv`` — the per-rank timeline (columns of :mod:`labkit.runtime.timeline`), when given;
* ``emulated_timeline.csv`` and ``identity.json``'s ``emulation`` (label, the cluster profile with every
  number, the "as a model" factors) — for a run launched with ``emulate=`` (both timelines are kept);
* ``<name>.csv`` — any further tables.

Writes are atomic: everything goes into a hidden temporary folder that is renamed into place at the end,
so an interrupted save leaves no half record. A save that was killed leaves a ``.tmp-*`` folder, which
:func:`list_runs` ignores and the next :func:`save`, :func:`load` or :func:`list_runs` under the same root
removes once it is stale (:func:`remove_stale_temp`): its writer (host and pid recorded in ``.owner.json``)
is gone, or it is older than :data:`STALE_TMP_S` whoever wrote it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from labkit.paths import repo_root, runs_dir
from labkit.runtime.probes import cpu_cores

RECORDS_SUBDIR = "records"
STALE_TMP_S = 3600.0  # a record is written in well under a second: a temp folder this old is abandoned
_OWNER = ".owner.json"
_PROCESS_START = None


def _process_start_time() -> float:
    """Wall-clock time this process started (a temp folder older than that cannot be ours in progress)."""
    global _PROCESS_START
    if _PROCESS_START is None:
        import time

        try:
            ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
            uptime = float(Path("/proc/uptime").read_text().split()[0])
            _PROCESS_START = time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            _PROCESS_START = time.time()
    return _PROCESS_START


def remove_stale_temp(root: str | Path) -> list[Path]:
    """Remove ``.tmp-*`` folders under ``root`` left by interrupted saves; returns what was removed.

    Stale means: older than :data:`STALE_TMP_S`; or written on this host by a process that no longer runs (its
    pid and start time in ``.owner.json``); or, without an owner file (older labkit), last changed before this
    process started. A save in progress elsewhere is never touched."""
    import time

    from labkit.runtime.probes import pid_alive

    root = Path(root)
    removed = []
    try:
        entries = [d for d in root.iterdir() if d.name.startswith(".tmp-")]
    except OSError:
        return removed
    host = socket.gethostname()
    for d in entries:
        try:
            mtime = d.stat().st_mtime
            stale = time.time() - mtime > STALE_TMP_S
            if not stale:
                owner_path = d / _OWNER
                if owner_path.exists():
                    owner = json.loads(owner_path.read_text())
                    stale = owner.get("host") == host and not pid_alive(int(owner["pid"]), owner.get("start"))
                else:
                    stale = mtime < _process_start_time()
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if stale:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def git_identity(root: Path | None = None) -> dict:
    """``{"git_sha": ..., "git_dirty": bool}`` of the lab's checkout; ``"unknown"`` outside a git tree."""
    root = root or repo_root()
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5).stdout.strip() != ""
    except (OSError, subprocess.SubprocessError):
        sha, dirty = "", False
    return {"git_sha": sha or "unknown", "git_dirty": dirty}


def machine_identity(backend: str | None = None) -> dict:
    """Host, OS, Python/torch/labkit versions, CPU cores, GPU names (empty list without CUDA)."""
    import labkit

    ident = {"host": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
             "labkit": labkit.__version__, "cpu_cores": cpu_cores(), "gpus": []}
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            import torch
        except ImportError:
            torch = None
    if torch is not None:
        ident["torch"] = torch.__version__
        try:
            if torch.cuda.is_available():
                ident["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                ident["cuda"] = torch.version.cuda
                ident["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a broken driver or a build without NCCL must not stop a save
            pass
    if backend is not None:
        ident["backend"] = backend
    return ident


def identity(experiment: str, params: dict | None = None, *, world_size: int | None = None,
             backend: str | None = None, started: datetime.datetime | None = None) -> dict:
    """The identity of one run (see the module docstring)."""
    started = started or datetime.datetime.now(datetime.timezone.utc)
    return {"experiment": experiment, "params": dict(params or {}), "world_size": world_size,
            "start_time": started.isoformat(timespec="seconds"), **git_identity(), **machine_identity(backend)}


@dataclass
class Record:
    """A loaded run record: ``path``, ``identity`` (dict), ``metrics`` / ``timeline`` (DataFrames or None),
    ``tables`` (name -> DataFrame)."""

    path: Path
    identity: dict
    metrics: pd.DataFrame | None = None
    timeline: pd.DataFrame | None = None
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)

    @property
    def emulated(self) -> pd.DataFrame | None:
        """The emulated timeline of a run launched with ``emulate=`` (None otherwise); its profile is
        ``identity["emulation"]``."""
        return self.tables.get("emulated_timeline")


def _frame(obj) -> pd.DataFrame:
    if isinstance(obj, pd.DataFrame):
        return obj
    if isinstance(obj, dict):
        return pd.DataFrame([obj])
    return pd.DataFrame([*obj])


def save(experiment: str, params: dict | None = None, *, metrics=None, timeline: pd.DataFrame | None = None,
         tables: dict | None = None, result=None, root: str | Path | None = None,
         world_size: int | None = None, backend: str | None = None) -> Path:
    """Write a run record atomically and return its folder.

    Args:
        experiment: short name (letters, digits, ``-``, ``_``).
        params: the run's parameters (JSON-serialisable; others are written with ``str``).
        metrics: a DataFrame, a dict (one row) or a list of dicts (rows) of measured numbers.
        timeline: a timeline frame; defaults to ``result.timeline`` when ``result`` is a LaunchResult.
        tables: further named DataFrames.
        result: a :class:`~labkit.runtime.launcher.LaunchResult`, for its world size, backend and timeline (and,
            when it was emulated, its emulated timeline and profile).
        root: records folder (default ``runs/records``).

    Raises ValueError for an empty or unsafe experiment name or table name.
    """
    safe = experiment.replace("-", "").replace("_", "")
    if not experiment or not safe.isalnum():
        raise ValueError(f"experiment={experiment!r} must be non-empty letters, digits, '-' or '_'")
    emulation = getattr(result, "emulation", None) if result is not None else None
    if result is not None:
        world_size = world_size or getattr(result, "world_size", None)
        backend = backend or getattr(result, "backend", None)
        if timeline is None:
            timeline = getattr(result, "timeline", None)
    if emulation is not None and getattr(result, "emulated", None) is not None:
        tables = {**(tables or {}), "emulated_timeline": result.emulated}
    root = Path(root) if root is not None else runs_dir() / RECORDS_SUBDIR
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temp(root)
    started = datetime.datetime.now(datetime.timezone.utc)
    name = f"{started.strftime('%Y%m%dT%H%M%S')}_{experiment}_{uuid.uuid4().hex[:6]}"
    tmp = root / f".tmp-{name}"
    tmp.mkdir()
    try:
        from labkit.runtime.probes import process_start_ticks

        (tmp / _OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                              "start": process_start_ticks(os.getpid())}))
        ident = identity(experiment, params, world_size=world_size, backend=backend, started=started)
        if emulation is not None:
            ident["emulation"] = emulation.profile()
        (tmp / "identity.json").write_text(json.dumps(ident, indent=2, default=str))
        if metrics is not None:
            _frame(metrics).to_csv(tmp / "metrics.csv", index=False)
        if timeline is not None:
            timeline.to_csv(tmp / "timeline.csv", index=False)
        for tname, table in (tables or {}).items():
            if not tname.replace("_", "").replace("-", "").isalnum() or tname in ("metrics", "timeline"):
                raise ValueError(f"table name {tname!r} must be letters/digits/-/_ and not metrics/timeline")
            _frame(table).to_csv(tmp / f"{tname}.csv", index=False)
        (tmp / _OWNER).unlink()
        final = root / name
        os.replace(tmp, final)  # atomic on one filesystem: the record appears whole or not at all
        return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load(path: str | Path) -> Record:
    """Read a record folder. Raises ValueError if it has no identity.json (not a record)."""
    path = Path(path)
    remove_stale_temp(path.parent)
    ident_path = path / "identity.json"
    if not ident_path.exists():
        raise ValueError(f"{path} is not a run record (no identity.json)")
    rec = Record(path=path, identity=json.loads(ident_path.read_text()))
    for csv in sorted(path.glob("*.csv")):
        df = pd.read_csv(csv)
        if csv.stem == "metrics":
            rec.metrics = df
        elif csv.stem == "timeline":
            rec.timeline = df
        else:
            rec.tables[csv.stem] = df
    return rec


def list_runs(root: str | Path | None = None, experiment: str | None = None) -> pd.DataFrame:
    """One row per complete record under ``root`` (default runs/records), newest first: path, experiment,
    start_time, world_size, backend, host, git_sha, torch. Half-written ``.tmp-*`` folders are skipped."""
    root = Path(root) if root is not None else runs_dir() / RECORDS_SUBDIR
    remove_stale_temp(root)
    rows = []
    for d in sorted(root.glob("*/identity.json")) if root.exists() else []:
        if d.parent.name.startswith(".tmp-"):
            continue
        ident = json.loads(d.read_text())
        if experiment is not None and ident.get("experiment") != experiment:
            continue
        rows.append({"path": str(d.parent), **{k: ident.get(k) for k in (
            "experiment", "start_time", "world_size", "backend", "host", "git_sha", "torch")}})
    cols = ["path", "experiment", "start_time", "world_size", "backend", "host", "git_sha", "torch"]
    df = pd.DataFrame(rows, columns=cols)
    return df.sort_values("start_time", ascending=False, kind="stable").reset_index(drop=True)


# ``records.list`` as the design names it. Nothing in this module may call the builtin ``list`` (module
# globals are looked up at call time); tests/test_records.py exercises every path.
list = list_runs  # noqa: A001


# ------------------------------------------------------------------------------------------------------
# recorded references (GPU runs measured elsewhere and committed under data/reference/<kind>/)
# ------------------------------------------------------------------------------------------------------
def write_reference_doc(rows: list[dict], identity: dict, path: str | Path, fmt: str) -> Path:
    """Write ``{"format": fmt, "identity", "rows"}`` as JSON to ``path``, atomically (a temporary file
    renamed). Used by labkit.experiments.collectives and labkit.experiments.scaling; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"format": fmt, "identity": identity, "rows": rows}, indent=1, default=float))
    os.replace(tmp, path)
    return path


def load_reference_frames(files: list[Path], fmt: str, *, columns: list[str], no_reference: str,
                          transform=None) -> pd.DataFrame:
    """Read reference documents written by :func:`write_reference_doc`: the rows of every file (``transform``
    applied to each file's frame) with ``source`` (file name) and ``gpu`` (the identity's first GPU), and
    ``attrs["status"]`` saying they were recorded elsewhere. No files: an empty frame of ``columns`` plus
    ``source`` and ``gpu`` whose status is ``no_reference`` (never invented numbers). Raises ValueError for
    a file whose ``format`` is not ``fmt``."""
    frames = []
    for f in files:
        doc = json.loads(Path(f).read_text())
        if doc.get("format") != fmt:
            raise ValueError(f"{f}: format={doc.get('format')!r} is not valid; expected {fmt!r}")
        gpus = doc.get("identity", {}).get("gpus") or ["?"]
        df = pd.DataFrame(doc["rows"])
        frames.append((transform(df) if transform else df).assign(source=Path(f).name, gpu=gpus[0]))
    if not frames:
        df = pd.DataFrame(columns=[*columns, "source", "gpu"])
        df.attrs["status"] = no_reference
        return df
    df = pd.concat(frames, ignore_index=True)
    df.attrs["status"] = f"recorded elsewhere: {', '.join(Path(f).name for f in files)}"
    return df


# ------------------------------------------------------------------------------------------------------
# published references (numbers read from papers, benchmark threads and performance pages; never run here)
# ------------------------------------------------------------------------------------------------------
#: kind -> (file under data/reference/published/, columns every row must fill)
PUBLISHED = {
    "collectives": ("collectives.csv", ("source", "url", "read_on", "what", "op", "metric", "value", "unit", "gpu",
                                        "interconnect")),
    "training": ("training.csv", ("source", "url", "read_on", "what", "model", "gpu", "gpus")),
    "pipeline": ("pipeline.csv", ("source", "url", "read_on", "what", "schedule", "baseline", "metric", "value",
                                  "unit")),
}


_PUBLISHED_INTS = {"bytes", "nics_per_node", "nodes", "gpus_per_node", "world_size", "gpus", "tp", "pp", "dp", "cp",
                   "ep", "vpp", "seq_len", "global_batch_size", "micro_batch_size"}
_PUBLISHED_FLOATS = {"value", "params_b", "tflops_per_gpu", "mfu", "tokens_per_s_per_gpu"}


def _numeric(col: pd.Series, path: Path, name: str) -> pd.Series:
    out = pd.to_numeric(col, errors="coerce")
    bad = out.isna() & col.notna()
    if bad.any():
        raise ValueError(f"{path.name}: column {name!r} holds {col[bad].iloc[0]!r}, not a number")
    return out


def load_published(kind: str, root: str | Path | None = None) -> pd.DataFrame:
    """Published measurements of ``kind`` (``collectives``, ``training`` or ``pipeline``) from
    ``data/reference/published/<kind>.csv``, one row per number, with a ``label`` column
    ``published (<source>)`` for the figures. Every row carries its source URL and the date it was read
    (``read_on``); columns and units are described in that folder's README.md.

    Raises ValueError for an unknown kind, a missing file, or a row that leaves a required column empty.
    """
    if kind not in PUBLISHED:
        raise ValueError(f"kind={kind!r} is not a published kind; valid: {', '.join(PUBLISHED)}")
    name, required = PUBLISHED[kind]
    from labkit.paths import data_dir

    path = Path(root) / name if root is not None else data_dir() / "reference" / "published" / name
    if not path.is_file():
        raise ValueError(f"no published {kind} rows: {path} does not exist")
    df = pd.read_csv(path)
    for col in df.columns:
        if col in _PUBLISHED_INTS:
            df[col] = _numeric(df[col], path, col).astype("Int64")
        elif col in _PUBLISHED_FLOATS:
            df[col] = _numeric(df[col], path, col).astype(float)
    for col in required:
        empty = df[col].isna() if col in df.columns else pd.Series(True, index=df.index)
        if empty.any():
            lines = [int(i) + 2 for i in df.index[empty]][:5]
            raise ValueError(f"{path.name}: column {col!r} is empty in row(s) {lines} "
                             "(file line numbers); every published row needs it")
    df.insert(0, "label", "published (" + df["source"] + ")")
    df.attrs["status"] = f"published: {len(df)} rows from {df['source'].nunique()} sources ({path.name})"
    return df
