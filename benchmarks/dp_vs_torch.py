"""Hand-written data parallelism vs torch's, same model, same batch, same run (one launch, interleaved):

* bucketed, overlapped all-reduce (labkit.parallel.data.DataParallelBucket) vs DistributedDataParallel
  (its own C++ comm hook; same bucket size) — goal: ratio of tokens/s >= 0.95;
* ZeRO-3 from scratch (labkit.parallel.zero.ZeroDataParallel(stage=3)) vs FSDP2 fully_shard
  (labkit.parallel.zero.fsdp2) — goal >= 0.90.

Tokens/s are measured (global tokens per second, median over rounds); a ratio is the median over rounds of
the per-round ratio (the variants of one round ran back to back, under the same machine load), printed with
its spread over rounds. Before any ratio, each pair is checked to have trained the same model (every step's
loss and the final full weights, labkit.experiments.common.same_model_rows): a pair that did not fails the
launch and no ratio is printed (exit 1). Ratios are printed last; the exit status is 1 when a goal is missed.
Usage: python benchmarks/dp_vs_torch.py [--world-size 2] [--model lab-small-llama] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics

from labkit import launch
from labkit.cli import run_main
from labkit.experiments import data as dp_experiments
from labkit.experiments import zero as zero_experiments
from labkit.experiments.common import ratio_verdict, throughput_rank

GOALS = {("bucket", "ddp"): 0.95, ("zero3", "fsdp2"): 0.90}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--model", default="lab-small-llama")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    p.add_argument("--repeats", type=int, default=5, help="rounds (variants interleaved)")
    p.add_argument("--global-batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--bucket-cap-mb", type=float, default=4.0)
    p.add_argument("--backend", default="auto")
    args = p.parse_args(argv)
    cap = int(args.bucket_cap_mb * 2**20)
    runs = [{"variant": "bucket", "bucket_cap_bytes": cap},
            {"variant": "ddp", "bucket_cap_bytes": cap, "log_comm": False},  # DDP's own C++ all-reduce hook
            {"variant": "zero3"}, {"variant": "fsdp2"}]
    wrappers = {**dp_experiments.WRAPPERS, **zero_experiments.WRAPPERS}
    res = launch(throughput_rank, args.world_size, wrappers, runs, model=args.model, steps=args.steps,
                 repeats=args.repeats, global_batch_size=args.global_batch_size, seq_len=args.seq_len,
                 backend=args.backend, timeout_s=900, same_model=list(GOALS))
    tps = res[0]  # the ranks raised ParityError (the launch failed: exit 1) if a pair trained different models
    print(f"world_size={args.world_size} backend={res.backend} model={args.model} "
          f"global_batch_size={args.global_batch_size} seq_len={args.seq_len} steps={args.steps} "
          f"repeats={args.repeats}")
    print(f"{'variant':<8} {'median tokens/s':>16} {'min':>10} {'max':>10}   (measured, rank 0)")
    med = {}
    for label, vals in tps.items():
        med[label] = statistics.median(vals)
        print(f"{label:<8} {med[label]:16.1f} {min(vals):10.1f} {max(vals):10.1f}")
    for row in getattr(tps, "parity", []):
        print(f"same model {row['pair']}: max |loss diff| {row['max_loss_diff']:.2e}, max |weight diff| "
              f"{row['max_weight_diff']:.2e} (allowed {row['weight_atol']:.1e}): "
              f"{'same' if row['same'] else 'DIFFERENT'}")
    ok = True
    lines = []
    for (mine, theirs), goal in GOALS.items():
        # rounds interleave the variants, so each round's pair saw the same machine load: median of the ratios
        line, met = ratio_verdict(f"ratio {mine}/{theirs} tokens/s, per round",
                                          [a / b for a, b in zip(tps[mine], tps[theirs])], goal,
                                          higher_is_better=True)
        ok &= met
        lines.append(line)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(run_main("dp_vs_torch", main))
