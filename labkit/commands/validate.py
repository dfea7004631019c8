"""``labkit validate --profile NAME [--json]``: the emulator's timing model checked against this machine — the
lab's DP, TP and PP training steps at world size 2, each run measured and run emulated as profile NAME (a
profile ``labkit calibrate`` fitted, or any of data/hardware.yaml), side by side: measured, emulated and
emulated / measured. docs/calibration.md."""

from __future__ import annotations

NAME = "validate"
HELP = "run the lab's DP, TP and PP steps at world size 2, measured and emulated on a profile, side by side"


def add_arguments(p) -> None:
    p.add_argument("--profile", required=True, help="the profile to emulate (e.g. this-machine, from labkit calibrate)")
    p.add_argument("--runs", default="dp,tp,pp", help="comma-separated runs among dp, tp, pp (default all three)")
    p.add_argument("--steps", type=int, default=6, help="training steps per run (the first is warm-up; default 6)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 64)")
    p.add_argument("--micro-batch-size", type=int, default=None, help="sequences per micro-batch (default 2)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each launch may take (default 300)")
    p.add_argument("--tolerance", type=float, default=0.15, help="the band |ratio - 1| is checked against")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")


def format_table(rows: list[dict], tolerance: float) -> str:
    """The rows as text: run, mesh, measured, emulated, ratio, within the band."""
    label = rows[0]["emulated_label"] if rows else "emulated"
    out = [f"run  mesh          measured (this machine) s   {label} s   ratio   within +-{100 * tolerance:g} %"]
    for r in rows:
        out.append(f"{r['run']:<4} {r['mesh']:<13} {r['measured_s']:>25.4f}   {r['emulated_s']:>{len(label) + 2}.4f}"
                   f"   {r['ratio']:>5.3f}   {'yes' if r['within'] else 'no'}")
    return "\n".join(out)


def run(args) -> int:
    import json

    from labkit.checks import positive_float, positive_int
    from labkit.experiments import record as rec

    runs = [x.strip() for x in str(args.runs).split(",") if x.strip()]
    bad = [x for x in runs if x not in rec.STEP_RUNS] or ([] if runs else [args.runs])
    if bad:
        raise ValueError(f"--runs={args.runs!r}: each run must be one of {', '.join(rec.STEP_RUNS)}")
    steps = positive_int("--steps", args.steps)
    if steps < 2:
        raise ValueError(f"--steps={steps} must be >= 2 (the first step is warm-up)")
    tol = positive_float("--tolerance", args.tolerance)
    sizes = {}
    if args.seq_len is not None:
        sizes["seq_len"] = positive_int("--seq-len", args.seq_len)
    if args.micro_batch_size is not None:
        sizes["micro_batch_size"] = positive_int("--micro-batch-size", args.micro_batch_size)
    rows = rec.validate_runs(args.profile, runs=tuple(runs), steps=steps,
                             timeout_s=positive_float("--timeout", args.timeout), tolerance=tol, **sizes)
    print(json.dumps(rows, indent=2) if args.json else format_table(rows, tol))
    return 0
