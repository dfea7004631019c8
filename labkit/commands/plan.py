"""``labkit plan``: rank every valid mesh of a GPU cluster for training a model (predicted memory and step time).

Examples (--all: every ranked and rejected mesh, in the table or with --json)::

    labkit plan --model llama-3-70b --gpus 1024 --gpu h100-80gb --gpus-per-node 8 --seq 8192 --global-batch 1024
    labkit plan --model llama-3-70b --gpus 1024 --gpu h100-80gb --seq 8192 --global-batch 1024 --top 3 --json
    labkit plan --model mixtral-8x7b --gpus 64 --seq 4096 --global-batch 256 --micro-batch 1,2 --zero 1
    labkit plan --model llama-3.1-405b --gpus 16384 --seq 8192 --global-batch 2048 --schedules 1f1b,interleaved
    labkit plan --validate            # the planner and the calculator against published training runs (table)
    labkit plan --validate my_runs.csv --json   # the same for your own cluster's runs (training.csv's schema)

Pure prediction (labkit.theory.planner): no torch import. Bad input (an unknown model or GPU, a world that is not a
whole number of nodes, a model that fits on no mesh) is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json

NAME = "plan"
HELP = "rank the valid parallel meshes (dp, tp, pp, cp, ep) of a cluster for training a model (predicted)"


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. 1,2,4)") from None


def _name_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from labkit.theory import memory as m
    from labkit.theory import planner

    p.add_argument("--model", help="preset from data/models.yaml (e.g. llama-3-70b); required unless --validate")
    p.add_argument("--gpus", type=int, help="world size: GPUs in the cluster; required unless --validate")
    p.add_argument("--gpu", default="h100-80gb", help="GPU from data/hardware.yaml (e.g. h100-80gb)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs joined by NVLink in one node")
    p.add_argument("--inter-link", default=None,
                   help="link between nodes, one NIC's (data/hardware.yaml); default: the GPU's own cluster profile's "
                        "(ib-hdr for a100-80gb as in DGX A100, ib-ndr for h100-80gb)")
    p.add_argument("--nics-per-node", type=int, default=None,
                   help="NICs per node (default: one per GPU, rail-optimised as DGX nodes)")
    p.add_argument("--seq", type=int, default=4096, dest="seq_len", help="tokens per sequence")
    p.add_argument("--global-batch", type=int, dest="global_batch_size",
                   help="sequences per step; required unless --validate")
    p.add_argument("--micro-batch", type=_int_list, default=[1], dest="micro_batch_sizes",
                   help="micro-batch sizes to try, comma-separated (default 1)")
    p.add_argument("--zero", type=int, default=1, help="ZeRO stage over dp*cp (default 1: distributed optimizer)")
    p.add_argument("--recompute", default="auto", choices=planner.RECOMPUTE_CHOICES,
                   help="activation recompute; auto = the least that fits")
    p.add_argument("--no-sp", dest="sequence_parallel", action="store_false", help="no sequence parallelism")
    p.add_argument("--mfu", type=float, default=None,
                   help="price every op at this constant fraction of peak FLOP/s (default: none; compute is priced "
                        "kernel by kernel at each mesh's per-rank shapes, labkit.theory.kernels)")
    p.add_argument("--headroom", type=float, default=m.DEFAULT_HEADROOM, help="allocator headroom fraction")
    p.add_argument("--convention", default=planner.DEFAULT_CONVENTION, choices=list(m.CONVENTIONS),
                   help=f"bytes-per-parameter convention (default {planner.DEFAULT_CONVENTION}: Megatron-LM's, "
                        "6 + 12/dp with the distributed optimizer, as the planner's mesh is Megatron's)")
    p.add_argument("--activations", default=planner.DEFAULT_ACTIVATIONS, choices=m.ACTIVATION_MODELS,
                   help=f"activation model (default {planner.DEFAULT_ACTIVATIONS}: Megatron-LM's "
                        "theoretical_memory_usage formula; lab = the lab's torch model, korthikanti = Table 2 of "
                        "Korthikanti et al. 2022)")
    p.add_argument("--schedules", type=_name_list, default=list(planner.SCHEDULE_CHOICES),
                   help="pipeline schedules to consider, comma-separated (default all: "
                        f"{','.join(planner.SCHEDULE_CHOICES)})")
    p.add_argument("--max-vpp", type=int, default=planner.MAX_VPP, help="most interleaved chunks per rank")
    p.add_argument("--stage-layers", type=_int_list, default=None,
                   help="a fixed stage split, e.g. 7,8,...,8,7 (only meshes with pp = its length are scored)")
    p.add_argument("--first-stage-layers", type=int, default=None, help="layers on the first pipeline stage")
    p.add_argument("--last-stage-layers", type=int, default=None, help="layers on the last pipeline stage")
    p.add_argument("--validate", nargs="?", const=True, default=False, metavar="FILE",
                   help="print the published-runs validation table (data/reference/published/training.csv, or FILE: "
                        "a CSV in its schema, the model by preset name or by the columns layers, hidden, heads, "
                        "kv_heads, ffn, vocab, experts, top_k): each run's published, predicted and ratio MFU, the "
                        "published mesh's rank and its step time against the top pick's, then the goals")
    p.add_argument("--max-tp", type=int, default=None, help="largest tp to consider (>= 1; default: no cap)")
    p.add_argument("--top", type=int, default=10, help="ranked meshes to show (>= 1, default 10)")
    p.add_argument("--rejected", type=int, default=10,
                   help="rejected meshes to list in the table (>= 0, default 10)")
    p.add_argument("--all", action="store_true",
                   help="show every mesh: all ranked ones and all rejected ones (rank null in --json, with their "
                        "rules and reason); overrides --top and --rejected, in the table and with --json")
    p.add_argument("--emulate", type=int, default=None, metavar="N",
                   help="also emulate the top N meshes from fake-tensor traces at full shapes (one traced rank per "
                        "pipeline stage; labkit.experiments.fullscale.emulate_candidates) beside the predicted step "
                        "time; minutes per mesh")
    p.add_argument("--json", action="store_true",
                   help="print the ranked candidates as a JSON list (dp, tp, pp, cp, ep, fits, peak_bytes_per_gpu, "
                        "step_time_s, ...)")


def run(args) -> int:
    from labkit.checks import positive_int
    from labkit.theory import planner

    if args.validate:
        from labkit.theory.published import validate_published, validation_table

        ignored = _set_options(args) - {"--validate", "--mfu", "--convention", "--activations", "--headroom", "--json"}
        if ignored:  # each published run is checked at its own model, GPU count and batch
            raise ValueError(f"{', '.join(sorted(ignored))} do{'es' if len(ignored) == 1 else ''} not apply to "
                             "--validate (each published run is planned at its own model, GPUs and batch); "
                             "--validate takes --mfu, --convention, --activations, --headroom and --json")

        path = None if args.validate is True else args.validate
        if path is not None:
            from pathlib import Path

            if not Path(path).is_file():
                raise ValueError(f"--validate {path!r}: no such file; give a CSV in the schema of "
                                 "data/reference/published/training.csv (see its README.md)")
        rows = validate_published(mfu=args.mfu, convention=args.convention, activations=args.activations,
                                  headroom=args.headroom, path=path)
        if args.json:
            print(json.dumps(rows, indent=2, default=str))
        else:
            print(validation_table(rows))
        return 0
    missing = [f for f, v in (("--model", args.model), ("--gpus", args.gpus), ("--global-batch",
                                                                             args.global_batch_size)) if v is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} required (or use --validate)")
    top = positive_int("--top", args.top)
    n_rejected = positive_int("--rejected", args.rejected, minimum=0)
    if args.max_tp is not None:
        positive_int("--max-tp", args.max_tp)
    result = planner.plan(args.model, gpus=args.gpus, global_batch_size=args.global_batch_size, seq_len=args.seq_len,
                          gpu=args.gpu, gpus_per_node=args.gpus_per_node, micro_batch_sizes=args.micro_batch_sizes,
                          zero=args.zero, recompute=args.recompute, sequence_parallel=args.sequence_parallel,
                          mfu=args.mfu, inter_link=args.inter_link, headroom=args.headroom, max_tp=args.max_tp,
                          convention=args.convention, activations=args.activations, schedules=args.schedules,
                          max_vpp=args.max_vpp, nics_per_node=args.nics_per_node, layers_per_stage=args.stage_layers,
                          first_stage_layers=args.first_stage_layers, last_stage_layers=args.last_stage_layers)
    if args.emulate is not None:
        from labkit.experiments.fullscale import emulate_candidates

        rows = emulate_candidates(result.candidates, args.model, args.gpu, seq_len=args.seq_len,
                                  n=positive_int("--emulate", args.emulate))
        if args.json:
            print(json.dumps(rows, indent=2, default=str))
            return 0
        print(result.table(top=top, n_rejected=n_rejected))
        print("\nemulated from fake traces (full shapes) beside predicted (labkit.theory.planner), step seconds:")
        for r in rows:
            em = f"{r['emulated_s']:.4g}" if r["emulated_s"] is not None else "-"
            ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
            print(f"  #{r['rank']} dp{r['dp']} tp{r['tp']} pp{r['pp']} cp{r['cp']} ep{r['ep']}: predicted "
                  f"{r['predicted_s']:.4g}, {r['label'] or 'emulated'} {em}, ratio {ratio}; {r['note']}")
        return 0
    if args.all:
        top, n_rejected = len(result.candidates), len(result.rejected)
    if args.json:
        print(result.to_json(top, rejected=args.all))
        return 0
    print(result.table(top=top, n_rejected=n_rejected))
    return 0


def _set_options(args) -> set[str]:
    """The options of ``args`` given a value other than their default, by their flag (``--gpus``)."""
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    flags = {a.dest: a.option_strings[0] for a in p._actions if a.option_strings}
    defaults = vars(p.parse_args([]))
    return {flags[k] for k, v in vars(args).items() if k in flags and v != defaults[k]}
