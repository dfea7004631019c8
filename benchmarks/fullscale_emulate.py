"""Benchmark: llama-3-70b emulated at full scale from fake traces (labkit.experiments.fullscale.emulate_mesh).

Goals (issue 28; a benchmark, not a timed test): 1024 H100 (dp16 tp8 pp8) <= 60 s and <= 4 GiB of host memory on
a 2-core machine; 16,384 GPUs (dp256 tp8 pp8) <= 120 s. Prints the measured wall time, the peak resident memory
of this process and of the fake-tensor child (measured, ru_maxrss), the traced ranks, the replay's share, and
the emulated step beside the planner's predicted step time for the same mesh.

    .venv/bin/python benchmarks/fullscale_emulate.py [--meshes 16x8x8,256x8x8] [--microbatches 8]
"""

from __future__ import annotations

import argparse
import json
import resource
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3-70b")
    p.add_argument("--cluster", default="dgx-h100")
    p.add_argument("--meshes", default="16x8x8,256x8x8", help="dp x tp x pp, comma-separated")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--seq", type=int, default=8192)
    a = p.parse_args()
    from labkit.experiments.fullscale import emulate_mesh, planner_step

    for mesh in a.meshes.split(","):
        dp, tp, pp = (int(x) for x in mesh.split("x"))
        t0 = time.perf_counter()
        r = emulate_mesh(a.model, a.cluster, dp=dp, tp=tp, pp=pp, seq_len=a.seq, n_microbatches=a.microbatches)
        wall = time.perf_counter() - t0
        pred = planner_step(a.model, a.cluster, dp=dp, tp=tp, pp=pp, seq_len=a.seq, n_microbatches=a.microbatches)
        self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        child_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        print(json.dumps({"mesh": r["mesh"], "world_size": r["world_size"], "wall_s (measured)": round(wall, 1),
                          "trace_s (measured)": round(sum(r["trace_s"].values()), 1),
                          "replay_s (measured)": round(r["replay_s"], 1),
                          "peak_rss_GiB (measured, this process / fake child)": [round(self_rss / 2**30, 2),
                                                                                 round(child_rss / 2**30, 2)],
                          "goal_s": 60 if r["world_size"] <= 1024 else 120,
                          r["label"] + " step_s": round(r["emulated_s"], 3),
                          "predicted (labkit.theory.planner) step_s": round(pred, 3) if pred else None,
                          "traced_ranks": r["traced_ranks"]}))


if __name__ == "__main__":
    main()
