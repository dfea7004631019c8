"""``labkit memory``: predicted memory per rank for training or inference, as a table (or one JSON object).

Examples::

    labkit memory --model llama-3-70b --mode train --dp 8 --tp 8 --pp 2 --zero 1 --micro-batch 1 --seq 4096 \\
        --recompute selective --attention flash --sp --device h100-80gb
    labkit memory --model llama-3-70b --mode infer --batch 32 --prompt 2048 --output 512 --weights int8 \\
        --device h100-80gb
    labkit memory --params 7.5e9 --mode train --dp 64 --zero 2          # model states only
    labkit memory --model llama-3.1-405b --tp 8 --pp 16 --dp 64 --zero 1 --sp --seq 8192 --microbatches 32 \\
        --stage-layers 7,8,8,8,8,8,8,8,8,8,8,8,8,8,8,7 --device h100-80gb        # uneven stages
    labkit memory --model gpt-3-175b --tp 8 --pp 8 --sp --seq 2048              # vocabulary padded for tp

Every option applies to some of three cases: training a preset (``--model``), training a bare parameter count
(``--params``: model states only, no layers, so no activations) and inference (``--mode infer``). An option
given where it cannot apply is refused (one line, exit 2) rather than silently ignored.

Pure prediction (labkit.theory.memory): no torch import, answers in milliseconds.
"""

from __future__ import annotations

import argparse
import json

NAME = "memory"
HELP = "predict memory per rank (training or inference) for a model and parallel layout"

TRAIN, PARAMS, INFER = "train", "params", "infer"
#: option dest -> (flag, the cases it applies to, default when not given)
OPTIONS = {
    "cp": ("--cp", {TRAIN, INFER}, 1),
    "ep": ("--ep", {TRAIN, INFER}, 1),
    "zero": ("--zero", {TRAIN, PARAMS}, 0),
    "shard_layout": ("--shard-layout", {TRAIN, PARAMS}, "even"),
    "sp": ("--sp", {TRAIN}, False),
    "vpp": ("--vpp", {TRAIN}, 1),
    "stage_layers": ("--stage-layers", {TRAIN, INFER}, None),
    "first_stage_layers": ("--first-stage-layers", {TRAIN, INFER}, None),
    "last_stage_layers": ("--last-stage-layers", {TRAIN, INFER}, None),
    "schedule": ("--schedule", {TRAIN}, None),
    "micro_batch_size": ("--micro-batch", {TRAIN}, 1),
    "seq": ("--seq", {TRAIN}, 2048),
    "n_microbatches": ("--microbatches", {TRAIN}, 1),
    "recompute": ("--recompute", {TRAIN}, "none"),
    "attention": ("--attention", {TRAIN, INFER}, "flash"),
    "dropout": ("--dropout", {TRAIN}, None),
    "act_dtype": ("--act-dtype", {TRAIN}, None),
    "activation_model": ("--activation-model", {TRAIN}, "lab"),
    "kernels": ("--kernels", {TRAIN}, "cuda"),
    "optimizer": ("--optimizer", {TRAIN, PARAMS}, "adamw"),
    "convention": ("--convention", {TRAIN, PARAMS}, "zero"),
    "param_dtype": ("--param-dtype", {TRAIN, PARAMS}, None),
    "grad_dtype": ("--grad-dtype", {TRAIN, PARAMS}, None),
    "optimizer_dtype": ("--optimizer-dtype", {TRAIN, PARAMS}, None),
    "master_weights": ("--master-weights", {TRAIN, PARAMS}, None),
    "batch": ("--batch", {INFER}, 1),
    "prompt_len": ("--prompt", {INFER}, 2048),
    "output_len": ("--output", {INFER}, 256),
    "weight_dtype": ("--weights", {INFER}, "bf16"),
    "kv_dtype": ("--kv-dtype", {INFER}, None),
    "prefill_tokens": ("--prefill-tokens", {INFER}, None),
}
_WHY = {
    PARAMS: "with --params (a bare parameter count has no layers: only model states are estimated); give "
            "--model NAME to estimate activations and buffers",
    INFER: "with --mode infer",
    TRAIN: "with --mode train (it is an inference option: add --mode infer)",
}
_HINT = {("zero", INFER): " (inference holds no optimizer state)", ("seq", INFER): " (use --prompt and --output)"}
MODEL_STATES = ("parameters", "gradients", "optimizer")


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of layer counts (e.g. 7,8,8,7)") \
            from None


def _float_count(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (e.g. 7.5e9)") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    from labkit.theory import memory as m

    what = p.add_mutually_exclusive_group()
    what.add_argument("--model", help="preset from data/models.yaml (e.g. llama-3-70b)")
    what.add_argument("--params", type=_float_count,
                      help="bare parameter count (e.g. 7.5e9): training model states only, no activations")
    p.add_argument("--mode", default="train", choices=m.MODES)
    g = p.add_argument_group("parallel layout")
    for name in ("dp", "tp", "pp"):
        g.add_argument(f"--{name}", type=int, default=1)
    g.add_argument("--cp", type=int, default=None, help="context parallel degree (default 1; needs --model)")
    g.add_argument("--ep", type=int, default=None, help="expert parallel degree (default 1; needs an MoE --model)")
    g.add_argument("--zero", type=int, default=None, help="ZeRO stage 0-3 (FSDP = 3) over dp*cp (default 0; training)")
    g.add_argument("--shard-layout", default=None, choices=m.SHARD_LAYOUTS,
                   help="how ZeRO splits each tensor: even (ceil(numel/N), default) or dim0 (FSDP2's dim-0 chunks)")
    g.add_argument("--sp", action="store_true", default=None, help="sequence parallelism (needs --tp > 1)")
    g.add_argument("--vpp", type=int, default=None,
                   help="model chunks per pipeline rank (default 1; > 1 implies --schedule interleaved)")
    g.add_argument("--schedule", default=None, choices=m.SCHEDULES, help="pipeline schedule (default 1f1b)")
    g.add_argument("--stage-layers", type=_int_list, default=None, dest="stage_layers",
                   help="layers of each pipeline stage, comma-separated (e.g. 7,8,...,8,7; pp counts summing to "
                        "n_layers); default: even when pp divides n_layers, else fewer on the first and last stages")
    g.add_argument("--first-stage-layers", type=int, default=None,
                   help="layers on the first stage (Megatron's --decoder-first-pipeline-num-layers); the other "
                        "stages split the rest evenly")
    g.add_argument("--last-stage-layers", type=int, default=None,
                   help="layers on the last stage (Megatron's --decoder-last-pipeline-num-layers)")
    t = p.add_argument_group("training (with --model)")
    t.add_argument("--micro-batch", type=int, default=None, dest="micro_batch_size", help="default 1")
    t.add_argument("--seq", type=int, default=None, help="sequence length (default 2048)")
    t.add_argument("--microbatches", type=int, default=None, dest="n_microbatches",
                   help="micro-batches per step (default 1)")
    t.add_argument("--recompute", default=None, choices=m.RECOMPUTE, help="default none")
    t.add_argument("--attention", default=None, choices=m.ATTENTION, help="default flash (training and inference)")
    t.add_argument("--dropout", type=float, default=None, help="dropout probability (default: the model's)")
    t.add_argument("--act-dtype", default=None, choices=list(m.DTYPE_BITS))
    t.add_argument("--activation-model", "--activations", default=None, choices=m.ACTIVATION_MODELS,
                   dest="activation_model",
                   help="default lab (what torch autograd saves for the lab's model, byte-exact on CPU); korthikanti "
                        "(Table 2 of Korthikanti et al. 2022); megatron (Megatron-LM's theoretical_memory_usage.py, "
                        "the planner's default)")
    t.add_argument("--kernels", default=None, choices=m.KERNELS,
                   help="whose kernels' saved tensors to assume (default cuda)")
    s = p.add_argument_group("model states (training, with --model or --params)")
    s.add_argument("--optimizer", default=None, choices=m.OPTIMIZERS, help="default adamw")
    s.add_argument("--convention", default=None, choices=list(m.CONVENTIONS),
                   help="bytes-per-parameter convention (default zero)")
    s.add_argument("--param-dtype", default=None, choices=list(m.DTYPE_BITS))
    s.add_argument("--grad-dtype", default=None, choices=list(m.DTYPE_BITS))
    s.add_argument("--optimizer-dtype", default=None, choices=list(m.DTYPE_BITS))
    s.add_argument("--master-weights", default=None, action=argparse.BooleanOptionalAction,
                   help="fp32 master weights on/off (default: the convention's)")
    i = p.add_argument_group("inference (--mode infer)")
    i.add_argument("--batch", type=int, default=None, help="concurrent sequences (default 1)")
    i.add_argument("--prompt", type=int, default=None, dest="prompt_len", help="default 2048")
    i.add_argument("--output", type=int, default=None, dest="output_len", help="default 256")
    i.add_argument("--weights", default=None, dest="weight_dtype", choices=("fp32", "bf16", "fp16", "int8", "int4"),
                   help="default bf16")
    i.add_argument("--kv-dtype", default=None, choices=("fp32", "bf16", "fp16", "fp8", "int8"))
    i.add_argument("--prefill-tokens", type=int, default=None, help="tokens prefilled per step (default one prompt)")
    o = p.add_argument_group("verdict and output")
    o.add_argument("--device", default=None, help="device from data/hardware.yaml (e.g. h100-80gb)")
    o.add_argument("--headroom", type=float, default=m.DEFAULT_HEADROOM,
                   help=f"allocator headroom, a fraction of the rest in [0, {m.MAX_HEADROOM:g}] "
                        f"(default {m.DEFAULT_HEADROOM})")
    o.add_argument("--workspace-bytes", type=int, default=None,
                   help="runtime workspace (default 1 GiB with --device, else 0)")
    o.add_argument("--unit", default="GiB", choices=("GiB", "GB", "MiB", "MB", "bytes"))
    o.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    o.add_argument("--measure", action="store_true",
                   help="also run the layout at full shapes under fake tensors (labkit.experiments.fullscale: one "
                        "strategy at a time: --dp with --zero 0/1/2/3 or --shard-layout dim0 (FSDP2), --tp with --sp, "
                        "or --pp) and print the column 'measured (fake tensors)' beside the prediction; minutes for "
                        "a 70B model")


def _shown(dest: str, value) -> str:
    flag = OPTIONS[dest][0]
    if isinstance(value, bool):
        return flag if value or dest == "sp" else f"--no-{flag[2:]}"
    return f"{flag}={value}"


def resolve(args) -> tuple[str, dict]:
    """The case (``train``, ``params`` or ``infer``) and every option's value, defaults filled in. Raises
    ValueError naming the first option given where it cannot apply, ``--sp`` without tensor parallelism, or
    no model at all."""
    from labkit.theory.spec import presets

    if args.model is None and args.params is None:
        raise ValueError("give --model NAME (a preset) or --params N (a bare parameter count); valid presets: "
                         + ", ".join(sorted(presets())))
    if args.mode == "infer" and args.params is not None:
        raise ValueError("--mode infer needs --model NAME, not --params: the KV cache depends on layers and heads")
    case = INFER if args.mode == "infer" else (PARAMS if args.params is not None else TRAIN)
    values, refused = {}, []
    for dest, (_flag, where, default) in OPTIONS.items():
        value = getattr(args, dest)
        if value is not None and case not in where:
            refused.append(_shown(dest, value) + _HINT.get((dest, case), ""))
        values[dest] = default if value is None else value
    if refused:
        raise ValueError(f"{', '.join(refused)} {'does' if len(refused) == 1 else 'do'} not apply {_WHY[case]}")
    if values["sp"] and args.tp == 1:
        raise ValueError("--sp (sequence parallelism) splits activations over the tensor-parallel ranks; it needs "
                         "--tp > 1, got --tp 1")
    if values["schedule"] is None:
        values["schedule"] = "interleaved" if values["vpp"] > 1 else "1f1b"
    if values["stage_layers"] is not None and (values["first_stage_layers"] or values["last_stage_layers"]):
        raise ValueError("give --stage-layers or --first-stage-layers/--last-stage-layers, not both")
    return case, values


def _split(args, v):
    """The stage split the options ask for (None: the calculator derives it)."""
    from labkit.theory import memory as m
    from labkit.theory.spec import get_spec

    if v["stage_layers"] is not None:
        return tuple(v["stage_layers"])
    if v["first_stage_layers"] is None and v["last_stage_layers"] is None:
        return None
    return m.split_layers(get_spec(args.model).n_layers, args.pp, v["vpp"], first=v["first_stage_layers"],
                          last=v["last_stage_layers"])


def _measure_strategy(args, v) -> tuple[str, int]:
    """(strategy, degree) of labkit.experiments.fullscale for a --measure layout; ValueError otherwise."""
    degrees = {k: getattr(args, k) for k in ("dp", "tp", "pp")}
    used = [k for k, d in degrees.items() if d > 1] + [k for k in ("cp", "ep") if (v[k] or 1) > 1]
    if used == ["dp", "ep"] and v["ep"] == args.dp and not v["zero"]:
        return "ep", args.dp  # expert parallel over the data-parallel ranks (MoE presets)
    other = [OPTIONS[k][0] for k in ("recompute", "attention", "act_dtype", "activation_model", "kernels",
                                     "optimizer", "convention", "vpp", "stage_layers") if getattr(args, k, None)]
    if args.model is None or args.mode != "train" or len(used) != 1 or other:
        raise ValueError("--measure runs one strategy of a preset's training step: --model NAME with exactly one of "
                         "--dp N (--zero 0/1/2/3, --shard-layout dim0 for FSDP2), --tp N --sp, --pp N, or --dp N "
                         "--ep N (an MoE preset) "
                         f"(got {', '.join(f'--{k}' for k in used) or 'no degree > 1'}"
                         f"{'; not with ' + ', '.join(other) if other else ''}: the fake run uses bf16, torch AdamW, "
                         "flash attention, no recompute)")
    dim = used[0]
    if dim == "dp":
        z, lay = v["zero"], v["shard_layout"]
        return ("fsdp2" if lay == "dim0" and z == 3 else "ddp" if z == 0 else f"zero{z}"), args.dp
    if dim == "tp":
        if not v["sp"]:
            raise ValueError("--measure with --tp runs the lab's TP with sequence parallelism: add --sp")
        return "tp_sp", args.tp
    if dim == "pp":
        return "pp", args.pp
    raise ValueError(f"--measure does not run --{dim} yet (context parallelism is not wired; ep runs as --dp N "
                     "--ep N); measure dp, tp + sp, pp or dp = ep")


def _measure(args, v) -> int:
    from labkit.experiments.fullscale import measure_memory

    strategy, n = _measure_strategy(args, v)
    r = measure_memory(args.model, strategy, n, seq_len=v["seq"], micro_batch_size=v["micro_batch_size"],
                       n_microbatches=v["n_microbatches"] if args.pp > 1 else None, device=args.device)
    if args.json:
        print(json.dumps(r, indent=2, default=str))
        return 0
    div = {"GiB": 2**30, "GB": 1e9, "MiB": 2**20, "MB": 1e6, "bytes": 1}[args.unit]
    print(f"model: {args.model}, {strategy} over {n} ranks, seq {r['seq_len']}, micro-batch {r['micro_batch_size']}"
          + (f", {r['n_microbatches']} micro-batches, stage {r['stage']} (the highest measured peak)"
             if strategy == "pp" else "") + f"; bytes per rank in {args.unit}")
    print(f"{'category':<14} {'predicted':>12} {'measured (fake tensors)':>24}")
    for k in ("parameters", "gradients", "optimizer", "activations", "temporary", "communication"):
        me = r["measured"].get(k)
        print(f"{k:<14} {r['predicted'][k] / div:>12.3f} {me / div if me is not None else float('nan'):>24.3f}")
    print(f"{'peak':<14} {r['predicted_peak_bytes'] / div:>12.3f} {r['measured_peak_bytes'] / div:>24.3f}   "
          f"ratio {r['ratio']:.3f}, peak in the {r['peak_phase']}"
          + (f" ({r['peak_module']})" if r["peak_module"] else ""))
    for a in r.get("assumptions") or []:
        print(f"  assumed: {a}")
    print("  predicted: labkit.theory.memory (torch-bf16 convention, cpu kernels' saved tensors, no headroom or "
          "workspace); measured (fake tensors): torch MemTracker at full shapes (communication buffers are "
          "counted in its temporary)")
    if r.get("verdict"):
        print(f"  {r['verdict']}")
    return 0


def run(args) -> int:
    from labkit.theory import memory as m

    case, v = resolve(args)
    if getattr(args, "measure", False):
        return _measure(args, v)
    common = dict(model=args.model if args.model is not None else args.params, dp=args.dp, tp=args.tp, pp=args.pp,
                  cp=v["cp"], ep=v["ep"], device=args.device, headroom=args.headroom,
                  workspace_bytes=args.workspace_bytes)
    if case != PARAMS:
        common["layers_per_stage"] = _split(args, v)
    if case == INFER:
        est = m.estimate("infer", **common, batch=v["batch"], prompt_len=v["prompt_len"], output_len=v["output_len"],
                         weight_dtype=v["weight_dtype"], kv_dtype=v["kv_dtype"], attention=v["attention"],
                         prefill_tokens=v["prefill_tokens"])
    else:
        states = {k: v[k] for k in ("zero", "shard_layout", "optimizer", "convention", "param_dtype", "grad_dtype",
                                    "optimizer_dtype", "master_weights")}
        if case == TRAIN:
            states.update(sequence_parallel=v["sp"], vpp=v["vpp"], schedule=v["schedule"],
                          micro_batch_size=v["micro_batch_size"], seq_len=v["seq"],
                          n_microbatches=v["n_microbatches"], recompute=v["recompute"], attention=v["attention"],
                          dropout=v["dropout"], act_dtype=v["act_dtype"], activation_model=v["activation_model"],
                          kernels=v["kernels"])
        est = m.estimate("train", **common, **states)
    if args.json:
        d = est.to_dict()
        d["model_state_bytes"] = est.model_state_bytes
        print(json.dumps(d, indent=2, default=str))
        return 0
    name = args.model or f"{args.params:.4g} parameters"
    print(f"model: {name} ({est.n_params / 1e9:.2f} B parameters, {est.n_params_local / 1e9:.3f} B on this rank)")
    print(est.table(args.unit))
    a = est.assumptions
    if a.get("vocab_padded_from"):
        print(f"  vocabulary padded {a['vocab_padded_from']} -> {a['vocab_size']} for tp={args.tp} (Megatron-LM's "
              f"rule: the next multiple of {m.VOCAB_MULTIPLE}*tp, as labkit plan pads it)")
    if a.get("layers_per_stage_text") and args.pp > 1:
        how = "given" if a.get("layers_per_stage_given") else (
            "derived: even" if len(set(a["layers_per_stage"])) == 1 else
            "derived: fewer layers on the first and last stages, which hold the embedding and the loss")
        print(f"  stage split: {a['layers_per_stage_text']} layers per pipeline stage ({how}); peak on stage "
              f"{est.stage}, the heaviest")
    if a.get("device_capacity"):
        print(f"  verdict against {a['device_capacity']}")
    if est.mode == "train":
        ms = est.model_state_bytes
        print(f"  model states (parameters + gradients + optimizer), predicted: {ms / 1e9:,.2f} GB (1e9 bytes) = "
              f"{ms / m.GiB:,.2f} GiB per rank, without workspace and headroom (what ZeRO's Fig. 1 counts)")
        print(f"  assumptions: convention {a['convention']} ({a['convention_source']})")
    if case == PARAMS:
        print("               model states only: a bare parameter count has no layers, so activations, temporary "
              "and communication buffers are not estimated (give --model NAME); the count is split evenly over "
              f"tp*pp; headroom {a['headroom_fraction']:.0%} of the rest")
    elif case == TRAIN:
        print(f"               activations: {a['activation_model']} model, recompute {a['recompute']}, "
              f"attention {a['attention']}, {a['in_flight_microbatches']:g} micro-batch(es) in flight, "
              f"headroom {a['headroom_fraction']:.0%} of the rest")
    else:
        print(f"  KV cache: {a['kv_formula']}; headroom {a['headroom_fraction']:.0%} of the rest")
    return 0
