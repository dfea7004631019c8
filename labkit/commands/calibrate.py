"""``labkit calibrate DIR --name NAME [--out PATH] [--json]``: fit a profile of the machine recorded in DIR
(``labkit record --out DIR``) on the recording's calibration rows, report the residuals of the calibration and
the validation rows, and write the profile (JSON) where ``launch(..., emulate=NAME)`` and
``get_cluster(NAME)`` find it: ``<runs>/profiles/NAME.json`` (or PATH; a folder in ``$LABKIT_PROFILES`` is
searched first). docs/calibration.md."""

from __future__ import annotations

NAME = "calibrate"
HELP = "fit a cluster profile on a recording's calibration rows (labkit record) and report its residuals"


def add_arguments(p) -> None:
    p.add_argument("recording", metavar="DIR", help="a folder written by labkit record (or its recording.csv)")
    p.add_argument("--name", required=True, help="the profile's name (e.g. this-machine)")
    p.add_argument("--out", default=None, help="where to write the profile (default <runs>/profiles/NAME.json)")
    p.add_argument("--json", action="store_true", help="print the profile as JSON instead of the tables")


def read_recording(path) -> tuple[list[dict], dict]:
    """The rows of ``path`` (a labkit record folder or its recording.csv) and its identity.json (or {}); a
    ``trace`` row gets its operations from traces.json (key ``op|shape``) as ``row["trace"]``.
    Raises ValueError when there is no recording there."""
    import csv
    import json
    from pathlib import Path

    p = Path(path)
    csv_path = p / "recording.csv" if p.is_dir() else p
    if not csv_path.is_file():
        raise ValueError(f"DIR={str(path)!r} holds no recording.csv; write one with labkit record --out DIR")
    with open(csv_path, newline="", encoding="utf-8") as f:
        rows = [dict(r) for r in csv.DictReader(f)]
    traces_path = csv_path.parent / "traces.json"
    traces = json.loads(traces_path.read_text(encoding="utf-8")) if traces_path.is_file() else {}
    for r in rows:
        if r.get("kind") == "trace":
            r["trace"] = traces.get(f"{r.get('op')}|{r.get('shape')}")
    ident_path = csv_path.parent / "identity.json"
    ident = json.loads(ident_path.read_text(encoding="utf-8")) if ident_path.is_file() else {}
    return rows, ident


def _check_name(name: str) -> str:
    import re

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", str(name)):
        raise ValueError(f"--name={name!r} must be 1-64 letters, digits, '.', '_' or '-' (a file name)")
    return name


def format_report(profile: dict, path) -> str:
    """The fitted parameters and the residual summaries as text."""
    lines = [f"profile {profile['name']} ({profile['label']}) written to {path}", "", "parameter            value"
             "          unit       source"]
    for n, p in profile["parameters"].items():
        lines.append(f"{n:<20} {p['value']:<14.6g} {p['unit']:<10} {p['source']}")
    if profile.get("per_op"):
        lines += ["", "per op (fit, Hockney):  alpha_s        busbw GB/s"]
        for op, d in profile["per_op"].items():
            lines.append(f"  {op:<20} {d['alpha_s']:<14.4g} {d['busbw_gbps']:.4g}")
    lines += ["", "residuals (fit / measured - 1)   rows   median |err|   max |err|"]
    for role in ("calibration", "validation"):
        s = profile["summary"][role]
        med = "-" if s["median_abs_error"] is None else f"{100 * s['median_abs_error']:.1f} %"
        mx = "-" if s["max_abs_error"] is None else f"{100 * s['max_abs_error']:.1f} %"
        lines.append(f"  {role:<30} {s['rows']:>4}   {med:>12}   {mx:>9}")
    ks = profile.get("kernel_sweep_fit")
    if ks:
        vals = ", ".join(f"{k}={v:.4g}" for k, v in ks["parameters"].items())
        lines.append(f"  the kernel sweep's own fit ({vals}) on the compute rows: median |err| calibration "
                     f"{100 * (ks['summary']['calibration']['median_abs_error'] or 0):.1f} %, validation "
                     f"{100 * (ks['summary']['validation']['median_abs_error'] or 0):.1f} %")
    by_kind: dict[tuple, list] = {}
    for role in ("calibration", "validation"):
        for r in profile["residuals"][role]:
            by_kind.setdefault((role, r["kind"]), []).append(abs(r["ratio"] - 1))
    for (role, kind), errs in sorted(by_kind.items()):
        errs.sort()
        lines.append(f"    {role} {kind:<14} {len(errs):>4}   {100 * errs[len(errs) // 2]:>10.1f} %   "
                     f"{100 * errs[-1]:>7.1f} %")
    return "\n".join(lines)


def run(args) -> int:
    import json

    from labkit.theory import calibrate as cal

    name = _check_name(args.name)
    rows, ident = read_recording(args.recording)
    profile = cal.calibrate_rows(rows, name=name, identity=ident)
    profile["recording"] = str(args.recording)
    path = cal.save_profile(profile, args.out)
    print(json.dumps(profile, indent=2) if args.json else format_report(profile, path))
    return 0
