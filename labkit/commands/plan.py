"""``labkit plan``: rank every valid mesh of a GPU cluster for training a model (predicted memory and step time).

Examples (--all: every ranked and rejected mesh, in the table or with --json)::

    labkit plan --model llama-3-70b --gpus 1024 --gpu h100-80gb --gpus-per-node 8 --seq 8192 --global-batch 1024
    labkit plan --model llama-3-70b --gpus 1024 --gpu h100-80gb --seq 8192 --global-batch 1024 --top 3 --json
    labkit plan --model mixtral-8x7b --gpus 64 --seq 4096 --global-batch 256 --micro-batch 1,2 --zero 1

Pure prediction (labkit.theory.planner): no torch import. Bad input (an unknown model or GPU, a world that is not a
whole number of nodes, a model that fits on no mesh) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse

NAME = "plan"
HELP = "rank the valid parallel meshes (dp, tp, pp, cp, ep) of a cluster for training a model (predicted)"


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. 1,2,4)") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    from labkit.theory import memory as m
    from labkit.theory import planner

    p.add_argument("--model", required=True, help="preset from data/models.yaml (e.g. llama-3-70b)")
    p.add_argument("--gpus", type=int, required=True, help="world size: GPUs in the cluster")
    p.add_argument("--gpu", default="h100-80gb", help="GPU from data/hardware.yaml (e.g. h100-80gb)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs joined by NVLink in one node")
    p.add_argument("--inter-link", default=planner.DEFAULT_INTER_LINK, help="link between nodes (data/hardware.yaml)")
    p.add_argument("--seq", type=int, default=4096, dest="seq_len", help="tokens per sequence")
    p.add_argument("--global-batch", type=int, required=True, dest="global_batch_size", help="sequences per step")
    p.add_argument("--micro-batch", type=_int_list, default=[1], dest="micro_batch_sizes",
                   help="micro-batch sizes to try, comma-separated (default 1)")
    p.add_argument("--zero", type=int, default=1, help="ZeRO stage over dp*cp (default 1: distributed optimizer)")
    p.add_argument("--recompute", default="auto", choices=planner.RECOMPUTE_CHOICES,
                   help="activation recompute; auto = the least that fits")
    p.add_argument("--no-sp", dest="sequence_parallel", action="store_false", help="no sequence parallelism")
    p.add_argument("--mfu", type=float, default=planner.DEFAULT_MFU,
                   help="assumed fraction of peak FLOP/s the compute kernels reach (default 0.5)")
    p.add_argument("--headroom", type=float, default=m.DEFAULT_HEADROOM, help="allocator headroom fraction")
    p.add_argument("--max-tp", type=int, default=None, help="largest tp to consider (>= 1; default: no cap)")
    p.add_argument("--top", type=int, default=10, help="ranked meshes to show (>= 1, default 10)")
    p.add_argument("--rejected", type=int, default=10,
                   help="rejected meshes to list in the table (>= 0, default 10)")
    p.add_argument("--all", action="store_true",
                   help="show every mesh: all ranked ones and all rejected ones (rank null in --json, with their "
                        "rules and reason); overrides --top and --rejected, in the table and with --json")
    p.add_argument("--json", action="store_true",
                   help="print the ranked candidates as a JSON list (dp, tp, pp, cp, ep, fits, peak_bytes_per_gpu, "
                        "step_time_s, ...)")


def run(args) -> int:
    from labkit.checks import positive_int
    from labkit.theory import planner

    top = positive_int("--top", args.top)
    n_rejected = positive_int("--rejected", args.rejected, minimum=0)
    if args.max_tp is not None:
        positive_int("--max-tp", args.max_tp)
    result = planner.plan(args.model, gpus=args.gpus, global_batch_size=args.global_batch_size, seq_len=args.seq_len,
                          gpu=args.gpu, gpus_per_node=args.gpus_per_node, micro_batch_sizes=args.micro_batch_sizes,
                          zero=args.zero, recompute=args.recompute, sequence_parallel=args.sequence_parallel,
                          mfu=args.mfu, inter_link=args.inter_link, headroom=args.headroom, max_tp=args.max_tp)
    if args.all:
        top, n_rejected = len(result.candidates), len(result.rejected)
    if args.json:
        print(result.to_json(top, rejected=args.all))
        return 0
    print(result.table(top=top, n_rejected=n_rejected))
    return 0
