"""``labkit memory``: predicted memory per rank for training or inference, as a table (or one JSON object).

Examples::

    labkit memory --model llama-3-70b --mode train --dp 8 --tp 8 --pp 2 --zero 1 --micro-batch 1 --seq 4096 \\
        --recompute selective --attention flash --sp --device h100-80gb
    labkit memory --model llama-3-70b --mode infer --batch 32 --prompt 2048 --output 512 --weights int8 \\
        --device h100-80gb
    labkit memory --params 7.5e9 --mode train --dp 64 --zero 2          # model states only

Pure prediction (labkit.memory): no torch import, answers in milliseconds.
"""

from __future__ import annotations

import argparse
import json

NAME = "memory"
HELP = "predict memory per rank (training or inference) for a model and parallel layout"


def _float_count(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 7.5e9)") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    from labkit import memory as m

    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", help="preset from data/models.yaml (e.g. llama-3-70b)")
    what.add_argument("--params", type=_float_count, help="bare parameter count: model states only (e.g. 7.5e9)")
    p.add_argument("--mode", default="train", choices=m.MODES)
    g = p.add_argument_group("parallel layout")
    for name in ("dp", "tp", "pp", "cp", "ep"):
        g.add_argument(f"--{name}", type=int, default=1)
    g.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3 (FSDP = 3), over dp*cp")
    g.add_argument("--sp", action="store_true", help="sequence parallelism (with tp)")
    g.add_argument("--vpp", type=int, default=1, help="model chunks per pipeline rank (implies --schedule interleaved)")
    g.add_argument("--schedule", default=None, choices=m.SCHEDULES, help="pipeline schedule (default 1f1b)")
    t = p.add_argument_group("training")
    t.add_argument("--micro-batch", type=int, default=1, dest="micro_batch_size")
    t.add_argument("--seq", type=int, default=None, help="sequence length (train; default 2048)")
    t.add_argument("--microbatches", type=int, default=1, dest="n_microbatches", help="micro-batches per step")
    t.add_argument("--recompute", default="none", choices=m.RECOMPUTE)
    t.add_argument("--attention", default="flash", choices=m.ATTENTION)
    t.add_argument("--dropout", type=float, default=None, help="dropout probability (default: the model's)")
    t.add_argument("--optimizer", default="adamw", choices=m.OPTIMIZERS)
    t.add_argument("--convention", default="zero", choices=list(m.CONVENTIONS), help="bytes-per-parameter convention")
    t.add_argument("--param-dtype", default=None, choices=list(m.DTYPE_BITS))
    t.add_argument("--grad-dtype", default=None, choices=list(m.DTYPE_BITS))
    t.add_argument("--optimizer-dtype", default=None, choices=list(m.DTYPE_BITS))
    t.add_argument("--act-dtype", default=None, choices=list(m.DTYPE_BITS))
    t.add_argument("--master-weights", default=None, action=argparse.BooleanOptionalAction,
                   help="fp32 master weights on/off (default: the convention's)")
    t.add_argument("--activation-model", default="lab", choices=m.ACTIVATION_MODELS)
    t.add_argument("--kernels", default="cuda", choices=m.KERNELS, help="whose kernels' saved tensors to assume")
    i = p.add_argument_group("inference")
    i.add_argument("--batch", type=int, default=1, help="concurrent sequences")
    i.add_argument("--prompt", type=int, default=2048, dest="prompt_len")
    i.add_argument("--output", type=int, default=256, dest="output_len")
    i.add_argument("--weights", default="bf16", dest="weight_dtype", choices=("fp32", "bf16", "fp16", "int8", "int4"))
    i.add_argument("--kv-dtype", default=None, choices=("fp32", "bf16", "fp16", "fp8", "int8"))
    i.add_argument("--prefill-tokens", type=int, default=None, help="tokens prefilled per step (default one prompt)")
    o = p.add_argument_group("verdict and output")
    o.add_argument("--device", default=None, help="device from data/hardware.yaml (e.g. h100-80gb)")
    o.add_argument("--headroom", type=float, default=m.DEFAULT_HEADROOM, help="fraction added for the allocator")
    o.add_argument("--workspace-bytes", type=int, default=None,
                   help="runtime workspace (default 1 GiB with --device, else 0)")
    o.add_argument("--unit", default="GiB", choices=("GiB", "GB", "MiB", "MB", "bytes"))
    o.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def run(args) -> int:
    from labkit import memory as m
    from labkit.spec import presets

    if args.model is None and args.params is None:
        raise ValueError("give --model NAME (a preset) or --params N (a bare parameter count); valid presets: "
                         + ", ".join(sorted(presets())))
    schedule = args.schedule or ("interleaved" if args.vpp > 1 else "1f1b")
    common = dict(model=args.model if args.model is not None else args.params, dp=args.dp, tp=args.tp, pp=args.pp,
                  cp=args.cp, ep=args.ep, zero=args.zero, sequence_parallel=args.sp, vpp=args.vpp, schedule=schedule,
                  device=args.device, headroom=args.headroom, workspace_bytes=args.workspace_bytes)
    if args.mode == "train":
        est = m.estimate("train", **common, micro_batch_size=args.micro_batch_size, seq_len=args.seq or 2048,
                         n_microbatches=args.n_microbatches, recompute=args.recompute, attention=args.attention,
                         dropout=args.dropout, optimizer=args.optimizer, convention=args.convention,
                         param_dtype=args.param_dtype, grad_dtype=args.grad_dtype,
                         optimizer_dtype=args.optimizer_dtype, act_dtype=args.act_dtype,
                         master_weights=args.master_weights, activation_model=args.activation_model,
                         kernels=args.kernels)
    else:
        if args.zero:
            raise ValueError(f"--zero={args.zero} is a training option (inference holds no optimizer state); "
                             "valid for --mode infer: 0")
        if args.seq is not None:
            raise ValueError(f"--seq={args.seq} is a training option; for inference use --prompt and --output")
        est = m.estimate("infer", **common, batch=args.batch, prompt_len=args.prompt_len,
                         output_len=args.output_len, weight_dtype=args.weight_dtype, kv_dtype=args.kv_dtype,
                         attention=args.attention, prefill_tokens=args.prefill_tokens)
    if args.json:
        print(json.dumps(est.to_dict(), indent=2, default=str))
        return 0
    name = args.model or f"{args.params:.4g} parameters"
    print(f"model: {name} ({est.n_params / 1e9:.2f} B parameters, {est.n_params_local / 1e9:.3f} B on this rank)")
    print(est.table(args.unit))
    a = est.assumptions
    if "convention" in a:
        print(f"  assumptions: convention {a['convention']} ({a['convention_source']})")
    if est.mode == "train" and not a.get("model_states_only"):
        print(f"               activations: {a['activation_model']} model, recompute {a['recompute']}, "
              f"attention {a['attention']}, {a['in_flight_microbatches']:g} micro-batch(es) in flight, "
              f"headroom {a['headroom_fraction']:.0%} of the rest")
    elif est.mode == "infer":
        print(f"               KV cache: {a['kv_formula']}; headroom {a['headroom_fraction']:.0%} of the rest")
    return 0
