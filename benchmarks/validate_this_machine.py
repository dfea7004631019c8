"""The closed loop on this machine: emulated / measured step time of the lab's DP, TP and PP runs at world size 2,
on a profile of this machine fitted on its own recording (issue 26's goal: within +-15 %).

Each round: ``labkit record`` (GEMMs, streaming kernels, traced one-rank training steps of lab-tiny-gpt,
collectives up to ``--max-size``) into ``runs/validate-this-machine/round-<k>``, ``labkit calibrate`` on it
(profile ``--name``, default this-machine, fitted on the recording's calibration rows only), then ``labkit
validate``: the DP, TP and PP steps of lab-tiny-llama (a model the fit never saw, with communication the traced
steps do not have) measured, and emulated on the fitted profile. Calibration and validation run back to back
in every round, so the machine's load (this machine is shared) hits both alike; the ratio is taken per round.

Prints every round's table, the fitted parameters and residuals, and one line per run (median over rounds of
emulated / measured, its spread); exit status 1 when a run's median is outside the band, 2 on bad arguments.
``--no-record`` validates an existing profile instead (one round per ``--rounds``).
"""

from __future__ import annotations

import argparse
import statistics
import time

from labkit.checks import positive_int
from labkit.cli import run_main

TOLERANCE = 0.15


def one_round(k: int, args) -> list[dict]:
    from labkit.commands.calibrate import format_report, read_recording
    from labkit.commands.record import record
    from labkit.experiments import record as rec
    from labkit.paths import runs_dir
    from labkit.theory import calibrate as cal

    if args.record:
        folder = runs_dir() / "validate-this-machine" / f"round-{k}"
        t0 = time.perf_counter()
        record(folder, parts=("gemm", "memory", "traces", "collectives"), max_size=args.max_size)
        rows, ident = read_recording(folder)
        prof = cal.calibrate_rows(rows, name=args.name, identity=ident)
        prof["recording"] = str(folder)
        path = cal.save_profile(prof)
        print(format_report(prof, path))
        print(f"round {k}: recorded and fitted in {time.perf_counter() - t0:.0f} s")
    rows = rec.validate_runs(args.name, steps=args.steps, tolerance=TOLERANCE)
    from labkit.commands.validate import format_table

    print(format_table(rows, TOLERANCE))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2, help="record + calibrate + validate rounds (default 2)")
    ap.add_argument("--steps", type=int, default=6, help="training steps per validated run (default 6)")
    ap.add_argument("--name", default="this-machine", help="the fitted profile's name (default this-machine)")
    ap.add_argument("--max-size", default="4M", help="largest collective recorded (default 4M)")
    ap.add_argument("--no-record", dest="record", action="store_false",
                    help="validate the existing profile --name without recording and fitting again")
    args = ap.parse_args(argv)
    rounds = positive_int("--rounds", args.rounds)
    if positive_int("--steps", args.steps) < 2:
        raise ValueError(f"--steps={args.steps} must be >= 2 (the first step is warm-up)")
    ratios: dict[str, list[float]] = {}
    for k in range(rounds):
        for r in one_round(k, args):
            ratios.setdefault(r["run"], []).append(r["ratio"])
    met_all = True
    for run, vals in ratios.items():
        med = statistics.median(vals)
        met = abs(med - 1) <= TOLERANCE
        met_all &= met
        print(f"{run}: emulated ({args.name}) / measured (this machine) step time = {med:.3f} (median of "
              f"{len(vals)} rounds; spread {min(vals):.3f} to {max(vals):.3f}) goal within +-{100 * TOLERANCE:g} %: "
              f"{'met' if met else 'NOT met'}")
    return 0 if met_all else 1


if __name__ == "__main__":
    raise SystemExit(run_main("validate_this_machine", main))
