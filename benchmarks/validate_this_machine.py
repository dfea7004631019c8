"""The closed loop on this machine: emulated / measured step time of the lab's DP, TP and PP runs at world size 2,
on a profile of this machine fitted on its own measurements (issue 26's goal: within +-15 %).

1. ``labkit record`` (GEMMs, streaming kernels, traced one-rank training steps of lab-tiny-gpt, collectives up to
   ``--max-size``) into ``runs/validate-this-machine``, ``labkit calibrate`` on it: the profile ``--name``
   (default this-machine), fitted on the recording's calibration rows only; its parameters and residuals printed.
2. The DP, TP and PP steps of lab-tiny-llama (a model the fit never saw, with the communication the traced
   steps do not have) run once under ``emulate=<profile>``: their traces.
3. This machine is shared and its load moves every timing by tens of percent within a minute, so the
   measurements are interleaved: one launch of 2 ranks runs ``--rounds`` rounds of [the calibration traced
   steps (timing only), the DP step, the TP step, the PP step], seconds apart. Per round, the profile's
   program parameters are fitted again on that round's calibration traced steps (the kernel and link fits of
   step 1 kept), the traces of step 2 are repriced on it (:meth:`Emulation.reprice`: nothing runs again) and
   divided by that round's measured steps: calibration and validation measured under the same load, a ratio
   per round.

Prints the profile, each round's ratios and one line per run (median over rounds of emulated / measured, its
spread); exit status 1 when a run's median is outside the band, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import statistics

from labkit.checks import positive_int
from labkit.cli import run_main

TOLERANCE = 0.15


def interleaved_rank(ctx, rounds: int, steps: int) -> list[dict]:
    """Rank function: ``rounds`` x [the recording's traced steps (timing only), the DP, TP and PP steps]."""
    from labkit.experiments import record as rec

    out = []
    for _ in range(rounds):
        traces = rec.trace_rank(ctx, rec.TRACE_RUNS, steps=2, trace=False)
        out.append({"traces": traces, "runs": {run: rec.step_rank(ctx, run, steps=steps) for run in rec.STEP_RUNS}})
    return out


def measure(args) -> dict[str, list[float]]:
    from labkit.commands.calibrate import format_report, read_recording
    from labkit.commands.record import record
    from labkit.experiments import record as rec
    from labkit.paths import runs_dir
    from labkit.runtime.launcher import launch
    from labkit.theory import calibrate as cal
    from labkit.theory.cluster import Cluster

    folder = runs_dir() / "validate-this-machine"
    record(folder, parts=("gemm", "memory", "traces", "collectives"), max_size=args.max_size)
    rows, ident = read_recording(folder)
    prof = cal.calibrate_rows(rows, name=args.name, identity=ident)
    prof["recording"] = str(folder)
    print(format_report(prof, cal.save_profile(prof)))
    traced = {run: launch(rec.step_rank, 2, run, steps=args.steps, emulate=args.name, timeout_s=600)
              for run in rec.STEP_RUNS}
    per_rank = launch(interleaved_rank, 2, args.rounds, args.steps, timeout_s=1800)
    ratios: dict[str, list[float]] = {}
    print(f"\nround  run  measured (this machine) s   emulated ({args.name}) s   ratio")
    for k in range(args.rounds):
        secs = {r["shape"]: r["seconds"] for r in per_rank[0][k]["traces"]}
        rows_k = [dict(r, seconds=secs.get(r["shape"], r["seconds"])) if r.get("kind") == "trace" else r
                  for r in rows]
        cluster = Cluster.from_dict(cal.calibrate_rows(rows_k, name=args.name, identity=ident)["cluster"])
        for run, res in traced.items():
            m = rec.step_seconds([s for rank in per_rank for s in rank[k]["runs"][run]])
            e = rec.step_seconds(rec._frame_steps(res.emulation.reprice(cluster).retime(res.timeline)))
            ratios.setdefault(run, []).append(e / m)
            print(f"{k:>5}  {run:<4} {m:>25.4f}   {e:>{len(args.name) + 13}.4f}   {e / m:.3f}")
    return ratios


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="interleaved measurement rounds (default 6)")
    ap.add_argument("--steps", type=int, default=3, help="training steps per run and round (first is warm-up)")
    ap.add_argument("--name", default="this-machine", help="the fitted profile's name (default this-machine)")
    ap.add_argument("--max-size", default="4M", help="largest collective recorded (default 4M)")
    args = ap.parse_args(argv)
    positive_int("--rounds", args.rounds)
    if positive_int("--steps", args.steps) < 2:
        raise ValueError(f"--steps={args.steps} must be >= 2 (the first step is warm-up)")
    met_all = True
    for name, vals in measure(args).items():
        med = statistics.median(vals)
        met = abs(med - 1) <= TOLERANCE
        met_all &= met
        print(f"{name}: emulated ({args.name}) / measured (this machine) step time = {med:.3f} (median of "
              f"{len(vals)} rounds; spread {min(vals):.3f} to {max(vals):.3f}) goal within +-{100 * TOLERANCE:g} %: "
              f"{'met' if met else 'NOT met'}")
    return 0 if met_all else 1


if __name__ == "__main__":
    raise SystemExit(run_main("validate_this_machine", main))
