"""Hand-written tensor parallelism vs torch's DTensor tensor parallelism: step time of the same model.

Both variants are built from the same full weights and trained on the same batches in the same launch,
interleaved step by step (labkit.experiments.tensor.step_time_rank), so machine load hits them alike. Prints
min / median / max measured step time per variant, checks that both reach the same losses, and prints the
hand/DTensor step-time ratio last: the median of the per-step ratios with their spread (goal <= 1.0: the
hand version issues the same collectives without DTensor's dispatch overhead). The exit status is 1 when the
goal is missed (2 for bad arguments).

    PYTHONPATH=. python benchmarks/tp_vs_dtensor.py [--world-size 2] [--model lab-small-llama] [--sp]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from labkit.cli import run_main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, default=2, help="tp degree = number of ranks (default 2)")
    ap.add_argument("--model", default="lab-small-llama", help="preset from data/models.yaml")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8, help="measured steps per variant")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--sp", action="store_true", help="sequence parallelism in both variants")
    args = ap.parse_args(argv)

    from labkit import launch
    from labkit.experiments import tensor as tpx
    from labkit.experiments.common import ratio_verdict
    from labkit.models import TOLERANCES
    from labkit.theory.tensor import check_tp

    variants = ("hand_sp", "dtensor_sp") if args.sp else ("hand", "dtensor")
    try:
        check_tp(args.model, args.world_size, sequence_parallel=args.sp, seq_len=args.seq_len, dtensor=True)
    except ValueError as e:
        print(f"tp_vs_dtensor: {e}", file=sys.stderr)
        return 2
    res = launch(tpx.step_time_rank, args.world_size, args.model, variants, batch_size=args.batch_size,
                 seq_len=args.seq_len, steps=args.steps, warmup=args.warmup, echo=False)
    r = res[0]
    print(f"model {args.model}, tp={args.world_size}, batch {args.batch_size} x seq {args.seq_len}, "
          f"{r['threads']} thread(s) per rank, backend {res.backend}; {args.steps} measured steps after "
          f"{args.warmup} warm-up")
    print(f"{'variant':<12} {'min_s':>9} {'median_s':>9} {'max_s':>9}   (measured step time)")
    med = {}
    for v in variants:
        t = r["step_s"][v]
        med[v] = statistics.median(t)
        print(f"{v:<12} {min(t):9.4f} {med[v]:9.4f} {max(t):9.4f}")
    la, lb = r["losses"][variants[0]], r["losses"][variants[1]]
    tol = TOLERANCES[__import__("torch").float32]
    worst = max(abs(a - b) for a, b in zip(la, lb))
    same = all(abs(a - b) <= tol["atol"] + tol["rtol"] * abs(b) for a, b in zip(la, lb))
    print(f"losses hand vs DTensor: max |diff| {worst:.2e} over {len(la)} steps ({'same' if same else 'DIFFERENT'})")
    if not same:
        print("tp_vs_dtensor: the two variants did not train the same model", file=sys.stderr)
        return 1
    # the variants ran interleaved step by step, so each step's pair saw the same machine load
    line, met = ratio_verdict("hand/DTensor step-time ratio, per step",
                                      [a / b for a, b in zip(r["step_s"][variants[0]], r["step_s"][variants[1]])],
                                      1.0, higher_is_better=False)
    print(line)
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(run_main("tp_vs_dtensor", main))
