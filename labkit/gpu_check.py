"""``make gpu-check`` / ``python3 -m labkit.gpu_check``: the GPU code paths, on one real GPU, against the datasheet.

Runs in a few minutes on one GPU with nothing but that machine's own ``python3`` and CUDA torch (>= 2.6): no
PyYAML (the data files are read by :mod:`labkit.yamlload`'s own reader where ``import yaml`` fails), plotly,
papermill, ipywidgets or pandas (``PYTHONPATH=. python3 -m labkit.gpu_check --out run.json``). Its stages:

1. ``collectives`` — NCCL at world size 1 (a real process group, ``init_method`` on 127.0.0.1): every
   collective the lab uses (all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single,
   broadcast, barrier), values checked, each timed with CUDA events;
2. ``matmul`` — CUDA-event timing against wall-clock timing (synchronised ``perf_counter``) of the same matmuls;
3. ``model_slice`` — a real-size model slice: ``--layers`` layers of Llama-3-8B's shape in bf16 (the lab's own
   transformer, embeddings and head included), one AdamW training step: parameter, gradient and optimizer bytes
   counted tensor by tensor and ``torch.cuda.max_memory_allocated`` of the step, beside
   :func:`labkit.theory.memory.train_memory` (convention ``torch-bf16``, flash attention, CUDA kernels);
4. ``mfu`` — bf16 matmul TFLOP/s and the slice's train-step MFU against the device's dense bf16 peak from
   ``data/hardware.yaml`` (the datasheet, not a measurement).

Each stage is guarded: an exception is recorded (``stages[name]``: status, seconds, error) and the next stage
runs. The record (format ``labkit-gpu-check/2``: identity — GPU, driver, torch, CUDA, NCCL, git sha — and every
number above) is written to ``--out`` (a file, or a folder for ``<UTC stamp>_<device>.json``; default
``data/reference/gpu_check/``) after every stage, so a crash or the time bound loses only the stage it was in.
``--time-limit`` (default 900 s) bounds the whole check: past it the record says which stage ran out of time
and the process exits 1; the process group's own timeout is the time left. Exit status: 0 when every check
passed, 1 when one failed or a stage raised (wrong collective values, model-state bytes off the calculator, an
MFU above 1), 2 for bad arguments, and 3 with one line ``gpu-check: skipped: <reason>`` where no CUDA GPU is
present — 0 instead with ``--allow-skip``, so a skip never reads as a pass by accident. ``--cpu-dry-run`` runs
the same stages on the CPU with gloo and a tiny model (tests/test_gpu_check.py): the path, not the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

FORMAT = "labkit-gpu-check/2"
STAGES = ("setup", "collectives", "matmul", "model_slice", "mfu")
#: exit status of a skip without --allow-skip
EXIT_SKIPPED = 3
#: nvidia-smi / torch device names -> data/hardware.yaml device (first match wins; checked in order)
DEVICE_NAMES = (("H200", "h200-141gb"), ("H100", "h100-80gb"), ("A100-SXM4-40GB", "a100-40gb"),
                ("A100 40GB", "a100-40gb"), ("A100", "a100-80gb"), ("B200", "b200-180gb"), ("L40S", "l40s-48gb"),
                ("RTX 4090", "rtx-4090-24gb"), ("MI300X", "mi300x-192gb"))
#: model-state bytes must equal the calculator's to this fraction; the step's peak is reported, not asserted
STATE_TOLERANCE = 0.01
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier")


def match_device(name: str) -> str | None:
    """The data/hardware.yaml device for a GPU name (``"NVIDIA H100 80GB HBM3"`` -> ``"h100-80gb"``), or None."""
    upper = name.upper()
    for key, dev in DEVICE_NAMES:
        if key.upper() in upper:
            return dev
    return None


def skip_reason() -> str | None:
    """Why the check cannot run here (no torch, a CPU-only torch, no visible GPU), or None when it can."""
    try:
        import torch
    except ImportError:
        return "no torch in this python"
    if not torch.cuda.is_available():
        return f"no CUDA GPU (torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'})"
    return None


# ------------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------------
def time_cuda(fn, *, iters: int = 10, warmup: int = 2, device=None) -> dict:
    """Time ``fn()`` with CUDA events (per call, ms) and with synchronised wall clock over the same calls.
    On a CPU ``device`` (the tests) both are wall clock. Returns {event_ms, wall_ms, min_ms, iters}."""
    import torch

    cuda = device is None or torch.device(device).type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    per = []
    t0 = time.perf_counter()
    if cuda:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for a, b in ev:
            a.record()
            fn()
            b.record()
        sync()
        per = [a.elapsed_time(b) for a, b in ev]
    else:
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            per.append((time.perf_counter() - t) * 1e3)
    wall = (time.perf_counter() - t0) * 1e3 / iters
    per.sort()
    return {"event_ms": per[len(per) // 2], "min_ms": per[0], "wall_ms": wall, "iters": iters}


# ------------------------------------------------------------------------------------------------------
# 1. collectives at world size 1
# ------------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_collectives(backend: str = "nccl", device: str = "cuda", nbytes: int = 64 * 2**20, iters: int = 10,
                    timeout_s: float = 300.0) -> list:
    """Every collective once for its values, then timed: one row per op {op, backend, bytes, ok, ms,
    algbw_gbps}. World size 1, so each result must equal its input (a broken backend shows up as wrong values
    or an exception, recorded as ``ok=False`` with the error). Creates and destroys its own process group,
    whose collectives time out after ``timeout_s`` seconds (NCCL's default is 10 minutes)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=max(1.0, timeout_s)))
    rows = []
    try:
        n = nbytes // 4
        x = torch.arange(n, device=device, dtype=torch.float32)
        out = torch.empty_like(x)
        # torch >= 2.12 names them *_single; older ones only have the *_tensor names
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        calls = {
            "all_reduce": lambda: dist.all_reduce(y := x.clone()) or y,
            "all_gather": lambda: gather(out, x) or out,
            "reduce_scatter": lambda: scatter(out, x) or out,
            "all_to_all": lambda: dist.all_to_all_single(out, x) or out,
            "broadcast": lambda: dist.broadcast(y := x.clone(), src=0) or y,
            "barrier": lambda: dist.barrier() or x,
        }
        for op in COLLECTIVES:
            row = {"op": op, "backend": backend, "bytes": 0 if op == "barrier" else nbytes}
            try:
                got = calls[op]()
                if device != "cpu":
                    torch.cuda.synchronize()
                row["ok"] = bool(torch.equal(got, x))
                t = time_cuda(calls[op], iters=iters, device=device)
                row["ms"] = t["event_ms"]
                row["algbw_gbps"] = row["bytes"] / (t["event_ms"] / 1e3) / 1e9 if row["bytes"] else None
            except Exception as e:  # noqa: BLE001 - a failing op is a result, reported in the record
                row.update(ok=False, error=f"{type(e).__name__}: {e}".splitlines()[0])
            rows.append(row)
    finally:
        dist.destroy_process_group()
    return rows


# ------------------------------------------------------------------------------------------------------
# 2. + 4. matmul: event vs wall clock, TFLOP/s against the datasheet
# ------------------------------------------------------------------------------------------------------
def run_matmul(n: int = 8192, iters: int = 20, device: str = "cuda", dtype_name: str = "bfloat16") -> dict:
    """An n x n x n matmul timed with CUDA events and with the synchronised wall clock: {n, event_ms, wall_ms,
    tflops (2n^3 per call over the event time), event_over_wall}."""
    import torch

    dtype = getattr(torch, dtype_name)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = time_cuda(lambda: a @ b, iters=iters, device=device)
    return {"n": n, "dtype": dtype_name, **t, "tflops": 2 * n**3 / (t["event_ms"] / 1e3) / 1e12,
            "event_over_wall": t["event_ms"] / t["wall_ms"]}


# ------------------------------------------------------------------------------------------------------
# 3. + 4. a real-size model slice: memory by category and train-step MFU
# ------------------------------------------------------------------------------------------------------
def slice_spec(model: str = "llama-3-8b", layers: int = 2):
    """``model``'s spec (data/models.yaml) with ``layers`` transformer layers: every tensor at full size."""
    from labkit.theory.spec import get_spec

    return dataclasses.replace(get_spec(model), n_layers=layers)


def predicted_train_memory(spec, micro_batch_size: int, seq_len: int, convention: str = "torch-bf16",
                           kernels: str = "cuda") -> dict:
    """The calculator's categories (bytes) for one rank, no parallelism, no headroom or workspace."""
    from labkit.theory import memory as mem

    act = "bf16" if convention == "torch-bf16" else "fp32"
    train = mem.TrainConfig(micro_batch_size=micro_batch_size, seq_len=seq_len, convention=convention,
                            attention="flash", kernels=kernels, act_dtype=act)
    est = mem.train_memory(spec, mem.ParallelConfig(), train, headroom=0.0, workspace_bytes=0)
    return {k: int(v) for k, v in est.categories.items()}


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def run_model_slice(spec, *, micro_batch_size: int = 1, seq_len: int = 2048, steps: int = 3, device: str = "cuda",
                    dtype_name: str = "bfloat16") -> dict:
    """One model slice trained for ``steps`` AdamW steps (the first is a warm-up that creates the optimizer
    state): parameter, gradient and optimizer bytes counted tensor by tensor, the peak allocated during a step
    (CUDA only; None on CPU) and the median step time (CUDA events)."""
    import torch

    from labkit.models import Transformer, lm_loss, make_optimizer

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(spec).to(dtype)
    opt = make_optimizer(model.parameters(), lr=1e-5)
    tokens = torch.randint(0, spec.vocab_size, (micro_batch_size, seq_len + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    cuda = torch.device(device).type == "cuda"
    grads = {}

    def step():
        loss = lm_loss(model(x), y)
        loss.backward()
        grads["bytes"] = _tensor_bytes(p.grad for p in model.parameters())
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: optimizer state now exists
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    t = time_cuda(step, iters=max(1, steps - 1), warmup=0, device=device)
    measured = {
        "parameters": _tensor_bytes(model.parameters()),
        "gradients": grads["bytes"],
        "optimizer": _tensor_bytes(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)),
    }
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return {"measured": measured, "peak_allocated_bytes": peak, "allocated_before_step_bytes": before if cuda else None,
            "step_ms": t["event_ms"], "tokens_per_step": micro_batch_size * seq_len,
            "n_params": sum(p.numel() for p in model.parameters())}


def compare_memory(measured: dict, predicted: dict, peak: int | None) -> dict:
    """Measured / predicted per model-state category (each must be 1 within STATE_TOLERANCE) and the step's
    peak over the calculator's total (reported: allocator caching and kernel workspaces are not modelled)."""
    rows = {}
    for cat in ("parameters", "gradients", "optimizer"):
        ratio = measured[cat] / predicted[cat] if predicted.get(cat) else float("nan")
        rows[cat] = {"measured_bytes": measured[cat], "predicted_bytes": predicted.get(cat, 0), "ratio": ratio,
                     "ok": abs(ratio - 1) <= STATE_TOLERANCE}
    total = sum(predicted.values())
    rows["peak"] = {"measured_bytes": peak, "predicted_bytes": total,
                    "ratio": (peak / total) if peak and total else None}
    return rows


def mfu(flops_per_s: float, peak_tflops: float) -> float:
    """Achieved FLOP/s over the datasheet's dense peak (TFLOP/s)."""
    return flops_per_s / (peak_tflops * 1e12)


# ------------------------------------------------------------------------------------------------------
# identity, record, main
# ------------------------------------------------------------------------------------------------------
def identity() -> dict:
    """Who ran it: host, python, torch/CUDA/NCCL versions, GPU name and capability, driver, git sha, time."""
    import torch

    import labkit

    ident = {"host": socket.gethostname(), "platform": platform.platform(), "python": platform.python_version(),
             "labkit": labkit.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
             "start_time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        ident.update(gpu=torch.cuda.get_device_name(0), gpus=[torch.cuda.get_device_name(i)
                                                             for i in range(torch.cuda.device_count())],
                     capability=f"{p.major}.{p.minor}", gpu_memory_bytes=p.total_memory)
        try:
            ident["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a build without NCCL still gets a record
            ident["nccl"] = None
    for key, cmd in (("driver", ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
                     ("git_sha", ["git", "rev-parse", "HEAD"])):
        try:
            ident[key] = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            ident[key] = None
    return ident


def default_record_path(device: str | None) -> Path:
    """``data/reference/gpu_check/<UTC stamp>_<device>.json``."""
    from labkit.paths import data_dir

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return data_dir() / "reference" / "gpu_check" / f"{stamp}_{device or 'unknown'}.json"


def record_path(out: str | Path | None, device: str | None) -> Path:
    """Where the record goes: ``out`` itself, or ``<stamp>_<device>.json`` inside ``out`` when it is a folder
    (an existing one, or a path ending in ``/``), or :func:`default_record_path` when ``out`` is None."""
    if out is None:
        return default_record_path(device)
    if Path(out).is_dir() or str(out).endswith(("/", os.sep)):
        return Path(out) / default_record_path(device).name
    return Path(out)


def write_record(result: dict, out: str | Path | None = None) -> Path:
    """Write ``result`` as ``{"format": FORMAT, ...}`` JSON to ``out`` (:func:`record_path`), atomically (a
    reader never sees half a record); returns the path. Raises OSError where the folder cannot be made."""
    out = record_path(out, result.get("device"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, **result}, indent=1, default=str) + "\n")
    os.replace(tmp, out)
    return out


def failures(result: dict) -> list[str]:
    """Every failed check of a result, as one line each: a stage that raised or ran out of time, wrong
    collective values, model-state bytes off the calculator, an MFU outside (0, 1]."""
    bad = [f"stage {name} raised {st['error']}" for name, st in result.get("stages", {}).items()
           if st.get("status") == "error"]
    if result.get("timed_out"):
        t = result["timed_out"]
        bad.append(f"stage {t['stage']} still running at the time limit ({t['limit_s']:.0f} s)")
    bad += [f"{r['op']}: {r.get('error') or 'wrong values'}" for r in result.get("collectives", []) if not r["ok"]]
    mem_rows = result.get("memory", {})
    bad += [f"{cat} bytes {v['measured_bytes']:,} vs predicted {v['predicted_bytes']:,}"
            for cat, v in mem_rows.items() if cat != "peak" and not v["ok"]]
    for what in ("matmul_mfu", "train_step_mfu"):
        v = result.get(what)
        if v is not None and not 0 < v <= 1:
            bad.append(f"{what}={v:.3f} is outside (0, 1]: the datasheet peak or the timing is wrong")
    return bad


def summary(result: dict) -> str:
    """The result as a few lines for a person."""
    where = result.get("identity", {}).get("gpu") or ("the CPU (dry run)" if result.get("dry_run") else None)
    lines = [f"gpu-check on {where} ({result.get('device') or 'no hardware.yaml entry'}, peak"
             f" {result.get('peak_bf16_tflops')} TFLOP/s dense bf16 per the datasheet)"]
    for r in result.get("collectives", []):
        bw = f", {r['algbw_gbps']:.1f} GB/s algbw" if r.get("algbw_gbps") else ""
        lines.append(f"  {r.get('backend', 'nccl')} {r['op']:<15} {'ok' if r['ok'] else 'FAILED'}"
                     + (f"  {r['ms']:.3f} ms{bw}" if r.get("ms") is not None else f"  {r.get('error', '')}"))
    m = result.get("matmul")
    if m:
        clock = "wall clock, twice" if result.get("dry_run") else "CUDA events"
        lines.append(f"  matmul {m['n']}^3 {m['dtype']}: {m['tflops']:.0f} TFLOP/s ({clock}; wall clock "
                     f"{m['wall_ms']:.3f} vs event {m['event_ms']:.3f} ms), MFU {result.get('matmul_mfu', 0):.1%}")
    for cat, v in result.get("memory", {}).items():
        if v.get("measured_bytes") is not None and v.get("ratio") is not None:
            lines.append(f"  memory {cat:<11} measured {v['measured_bytes'] / 2**30:8.3f} GiB, predicted "
                         f"{v['predicted_bytes'] / 2**30:8.3f} GiB, ratio {v['ratio']:.4f}")
    if result.get("train_step_mfu") is not None:
        s = result["slice"]
        lines.append(f"  train step ({s['layers']} layers of {s['model']}, {s['tokens_per_step']} tokens): "
                     f"{s['step_ms']:.1f} ms, MFU {result['train_step_mfu']:.1%}")
    bad = failures(result)
    lines.append("all checks passed" if not bad else "FAILED: " + "; ".join(bad))
    return "\n".join(lines)


class Check:
    """One gpu-check run: the result so far, the record it is written to after every stage, the stage running
    and the time limit (:meth:`expire` is what the watchdog calls when it passes)."""

    def __init__(self, out: str | Path | None, time_limit_s: float):
        self.result: dict = {"identity": {}, "device": None, "peak_bf16_tflops": None, "stages": {}}
        self.out, self.path, self.stage, self.limit_s = out, None, "setup", float(time_limit_s)
        self.t0 = time.monotonic()
        self._lock = threading.Lock()

    def left_s(self) -> float:
        """Seconds left before the time limit."""
        return self.limit_s - (time.monotonic() - self.t0)

    def save(self) -> Path:
        """Write the record as it stands (the same path every time); returns it."""
        with self._lock:
            self.result["seconds"] = round(time.monotonic() - self.t0, 1)
            self.path = write_record(self.result, self.path or record_path(self.out, self.result.get("device")))
            return self.path

    def stage_run(self, name: str, fn) -> bool:
        """Run one stage: its exception (if any) recorded in ``stages[name]`` with its seconds, the record saved
        either way. Returns whether it passed without raising."""
        self.stage, t = name, time.monotonic()
        try:
            fn()
            st = {"status": "ok"}
        except Exception as e:  # noqa: BLE001 - a stage that raises is a result; the next stage still runs
            st = {"status": "error", "error": f"{type(e).__name__}: {e}".splitlines()[0][:500],
                  "traceback": traceback.format_exc(limit=-4)[-4000:]}
        st["seconds"] = round(time.monotonic() - t, 3)
        self.result["stages"][name] = st
        self.save()
        return st["status"] == "ok"

    def expire(self):
        """The time limit passed: record which stage was running, save, print one line, end the process (exit
        1; a collective blocked in NCCL cannot be interrupted otherwise)."""
        self.result["timed_out"] = {"stage": self.stage, "limit_s": self.limit_s}
        try:
            path = self.save()
        except OSError as e:
            path = f"not written ({e})"
        print(f"gpu-check: FAILED: stage {self.stage} still running at the time limit ({self.limit_s:.0f} s); "
              f"record: {path}", flush=True)
        os._exit(1)


def run(args: argparse.Namespace, check: Check | None = None) -> dict:
    """Every stage (:data:`STAGES`) on GPU 0, or on the CPU with gloo for ``args.cpu_dry_run``; returns the
    result dict, which ``check`` has written after every stage."""
    check = check or Check(args.out, args.time_limit)
    r = check.result
    cpu = bool(args.cpu_dry_run)
    device, backend, dtype = ("cpu", "gloo", "float32") if cpu else ("cuda", "nccl", "bfloat16")
    convention, kernels = ("torch-fp32", "cpu") if cpu else ("torch-bf16", "cuda")
    r["dry_run"] = cpu
    spec = {}

    def setup():
        import torch

        if not cpu:
            torch.cuda.set_device(0)
        r["identity"] = identity()
        r["device"] = args.device or (None if cpu else match_device(r["identity"].get("gpu", "")))
        if r["device"]:
            from labkit.theory import memory as mem

            r["peak_bf16_tflops"] = mem.get_device(r["device"]).get("peak_bf16_tflops")

    def collectives():
        r["collectives"] = run_collectives(backend, device, nbytes=args.collective_bytes,
                                           timeout_s=min(300.0, check.left_s()))

    def matmul():
        r["matmul"] = run_matmul(args.matmul_n, device=device, dtype_name=dtype)

    def model_slice():
        spec["s"] = slice_spec(args.model, args.layers)
        s = run_model_slice(spec["s"], micro_batch_size=args.micro_batch, seq_len=args.seq, steps=args.steps,
                            device=device, dtype_name=dtype)
        pred = predicted_train_memory(spec["s"], args.micro_batch, args.seq, convention=convention, kernels=kernels)
        r["slice"] = {"model": args.model, "layers": args.layers, "micro_batch_size": args.micro_batch,
                      "seq_len": args.seq, "dtype": dtype, **{k: v for k, v in s.items() if k != "measured"}}
        r["predicted_categories"] = pred
        r["memory"] = compare_memory(s["measured"], pred, s["peak_allocated_bytes"])

    def mfu_stage():
        from labkit.theory.spec import flops_per_token

        peak = r.get("peak_bf16_tflops")
        if not peak:
            r["mfu_note"] = "no datasheet peak for this device (data/hardware.yaml): MFU not computed"
            return
        missing = [k for k in ("matmul", "slice") if k not in r]
        if missing:
            raise RuntimeError(f"needs the {' and '.join(missing)} results, whose stage failed")
        r["matmul_mfu"] = mfu(r["matmul"]["tflops"] * 1e12, peak)
        tok_s = r["slice"]["tokens_per_step"] / (r["slice"]["step_ms"] / 1e3)
        r["train_step_mfu"] = mfu(tok_s * flops_per_token(spec["s"], args.seq), peak)

    for name, fn in zip(STAGES, (setup, collectives, matmul, model_slice, mfu_stage)):
        check.stage_run(name, fn)
    return r


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, as every labkit CLI
        print(f"gpu-check: {message} (python3 -m labkit.gpu_check --help)", file=sys.stderr)
        sys.exit(2)


def _positive(kind):
    def parse(text):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not v > 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return v
    return parse


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python3 -m labkit.gpu_check", description=__doc__.splitlines()[0])
    pos_int, pos_float = _positive(int), _positive(float)
    p.add_argument("--model", default="llama-3-8b", help="preset whose layer shape the slice uses")
    p.add_argument("--layers", type=pos_int, default=2, help="transformer layers in the slice (default 2)")
    p.add_argument("--seq", type=pos_int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--micro-batch", type=pos_int, default=1, help="sequences per step (default 1)")
    p.add_argument("--steps", type=pos_int, default=4, help="training steps, the first a warm-up (default 4)")
    p.add_argument("--matmul-n", type=pos_int, default=8192, help="matmul size n (default 8192)")
    p.add_argument("--collective-bytes", type=pos_int, default=64 * 2**20,
                   help="bytes per collective (default 64 MiB)")
    p.add_argument("--device", default=None, help="data/hardware.yaml device (default: matched from the GPU name)")
    p.add_argument("--out", default=None, help="record file, or a folder for <stamp>_<device>.json "
                   "(default data/reference/gpu_check/); written after every stage")
    p.add_argument("--time-limit", type=pos_float, default=900.0,
                   help="seconds for the whole check; past it the record says where it stopped, exit 1 (default 900)")
    p.add_argument("--allow-skip", action="store_true", help="exit 0, not 3, where no CUDA GPU is present")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="every stage on the CPU with gloo (the code path, not GPU numbers); use a small --model")
    args = p.parse_args(argv)
    reason = None if args.cpu_dry_run else skip_reason()
    if reason:
        print(f"gpu-check: skipped: {reason}"
              + ("" if args.allow_skip else f" (exit {EXIT_SKIPPED}; --allow-skip exits 0)"))
        if args.out:
            write_record({"skipped": reason, "identity": {"host": socket.gethostname(),
                                                          "python": platform.python_version()}},
                         record_path(args.out, None))
        return 0 if args.allow_skip else EXIT_SKIPPED
    check = Check(args.out, args.time_limit)
    watchdog = threading.Timer(args.time_limit, check.expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        result = run(args, check)
    finally:
        watchdog.cancel()
    print(summary(result))
    print(f"record: {check.path}")
    return 1 if failures(result) else 0


if __name__ == "__main__":
    sys.exit(main())
