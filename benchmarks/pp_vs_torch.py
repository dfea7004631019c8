"""Hand-written 1F1B (labkit.parallel.pipeline.runner) vs torch.distributed.pipelining's Schedule1F1B.

Same model, same stage modules, same batches, same AdamW, in the SAME launch: the two implementations
alternate for ``--rounds`` rounds so that load from other processes hits both alike. Step time = wall time
of one training step on the slowest rank (barrier before each step), measured; min / median / max over all
timed steps. The last line is the ratio ours / torch of the median step times: the median over rounds of
each round's ratio (the two ran back to back, under the same load), with the spread over rounds (goal <=
1.0). Before the ratio, each round's two runs must have trained the same model (every timed step's loss
within fp32's labkit.models.TOLERANCES, rtol 1e-4 / atol 1e-5): otherwise no ratio is printed and the exit
status is 1. The exit status is also 1 when the goal is missed.

    PYTHONPATH=. python benchmarks/pp_vs_torch.py [--pp 2] [--spec lab-small-llama] [--n-microbatches 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from labkit.cli import run_main
from labkit.experiments import pipeline as pl
from labkit.experiments.common import ratio_verdict
from labkit.models import TOLERANCES
from labkit.theory.spec import get_spec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--spec", default="lab-small-llama")
    ap.add_argument("--n-microbatches", type=int, default=4)
    ap.add_argument("--global-batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per round and implementation")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    args = ap.parse_args(argv)

    spec = get_spec(args.spec)
    common = dict(schedule="1f1b", n_microbatches=args.n_microbatches, compute="real", spec=spec,
                  global_batch_size=args.global_batch_size, seq_len=args.seq_len, steps=args.steps,
                  warmup_steps=1, lr=1e-3)
    jobs = []
    for _ in range(args.rounds):
        jobs += [dict(common, impl="labkit"), dict(common, impl="torch")]
    runs = pl.run_pipelines(jobs, args.pp, timeout_s=args.timeout_s, echo=False)

    # the same model? each round's two runs started from the same weights and saw the same batches
    tol = TOLERANCES[torch.float32]
    by_round = list(zip(runs[0::2], runs[1::2]))
    worst = max((abs(a - b) for ours, theirs in by_round for a, b in zip(ours.losses, theirs.losses)), default=0.0)
    same = all(len(ours.losses) == len(theirs.losses) > 0 and
               all(abs(a - b) <= tol["atol"] + tol["rtol"] * abs(b) for a, b in zip(ours.losses, theirs.losses))
               for ours, theirs in by_round)
    print(f"losses labkit vs torch: max |diff| {worst:.2e} over {args.rounds} rounds x {args.steps} steps "
          f"({'same' if same else 'DIFFERENT'}; allowed {tol['atol']:g} + {tol['rtol']:g} x |loss|)")
    if not same:
        print("pp_vs_torch: the two implementations did not train the same model: no speed ratio", file=sys.stderr)
        return 1

    times = {"labkit": [], "torch": []}
    bubbles = {"labkit": [], "torch": []}
    per_round = {"labkit": [], "torch": []}
    for r in runs:
        times[r.job["impl"]] += list(r.steps["step_s"])
        bubbles[r.job["impl"]] += list(r.steps["bubble_fraction"])
        per_round[r.job["impl"]].append(statistics.median(r.steps["step_s"]))
    print(f"1F1B, pp={args.pp}, m={args.n_microbatches}, {spec.name} (n_layers={spec.n_layers}, "
          f"hidden={spec.hidden_size}), global_batch_size={args.global_batch_size}, seq_len={args.seq_len}, "
          f"gloo/CPU; {args.rounds} rounds x {args.steps} steps each (measured)")
    print(f"{'impl':8s} {'min_ms':>9s} {'median_ms':>10s} {'max_ms':>9s} {'bubble_median':>14s}")
    for impl, ts in times.items():
        print(f"{impl:8s} {min(ts) * 1e3:9.2f} {statistics.median(ts) * 1e3:10.2f} {max(ts) * 1e3:9.2f} "
              f"{statistics.median(bubbles[impl]):14.3f}")
    print(f"ratio labkit/torch best step time (measured, least disturbed) = "
          f"{min(times['labkit']) / min(times['torch']):.3f}")
    line, met = ratio_verdict("ratio labkit/torch median step time, per round",
                                      [a / b for a, b in zip(per_round["labkit"], per_round["torch"])], 1.0,
                                      higher_is_better=False)
    print(line)
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(run_main("pp_vs_torch", main))
