"""``labkit record``'s sweeps: a machine's GEMMs, memory-bound kernels, collectives and a few DP / TP / PP steps,
measured, as rows in one schema (``labkit calibrate`` fits a profile on them, docs/calibration.md).

Rank functions (first argument ``ctx``: ``rank``, ``world_size``, ``device``, ``barrier()``), run at the
recording's world size through :func:`labkit.launch` where the lab's full environment is installed, and through
:func:`run_ranks`'s small spawn runner where only ``python3`` and ``torch`` are (a lent GPU machine: pandas and
cloudpickle may be missing). Every rank runs the same case at the same time (a barrier before each), so a case
is measured under the load the lab's runs see (on this 2-core machine: two ranks, one thread each).

* :func:`gemm_rank` — ``torch.matmul`` of [m, k] @ [k, n] per shape and dtype;
* :func:`memory_rank` — ``torch.add(a, b, out=c)`` of n elements (a streaming kernel: 3 n e bytes);
* :func:`collective_rank` — every op at every size (S in the nccl-tests convention, as
  :class:`labkit.runtime.commlog.CommLog` counts it);
* :func:`step_rank` — :func:`labkit.experiments.emulate.step3d_rank`'s DP x TP x PP step (the lab's own pieces:
  bucketed DP, Megatron TP, a 1F1B pipeline), each step timed.

Timing: a case runs ``warmup`` times, then batches of calls sized to last about ``batch_s`` each;
``seconds`` = the fastest of ``repeats`` batches' (batch time / calls) (:data:`STATISTIC`: on a shared machine
other processes only add time), the slowest rank's. Host clock
(``time.perf_counter``) after ``torch.cuda.synchronize`` on a GPU. One call's Python and dispatch cost is part of
the time (it is what a program pays per operation).

Rows (:data:`COLUMNS`): ``kind`` (gemm / memory / collective / step), ``op``, ``shape`` (``m x n x k``,
``n``, or the run's mesh), ``dtype``, ``bytes`` (compute: inputs + output, as the emulator's tracer counts them;
collectives: S), ``flops``, ``seconds``, ``device``, ``link``, ``world_size``, ``threads``, the environment
identity (host, torch, python, CUDA, git sha, recorded_at) and ``label`` = ``measured (<machine>)``.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
import time
from pathlib import Path

#: the columns of a recording (recording.csv), in order
COLUMNS = ("kind", "op", "shape", "dtype", "bytes", "flops", "seconds", "device", "link", "world_size", "threads",
           "label", "role", "host", "torch", "python", "cuda", "git_sha", "recorded_at", "note")
#: the collectives a recording sweeps
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")
#: the DP, TP and PP runs: name -> (dp, tp, pp) at world size 2
STEP_RUNS = {"dp": (2, 1, 1), "tp": (1, 2, 1), "pp": (1, 1, 2)}
#: the lab model and sizes of the steps (labkit validate runs the same)
STEP_DEFAULTS = {"model": "lab-tiny-llama", "seq_len": 64, "micro_batch_size": 2, "n_microbatches": 4}
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}


# ------------------------------------------------------------------------------------------------------
# what to sweep
# ------------------------------------------------------------------------------------------------------
def gemm_shapes(on_gpu: bool, quick: bool = False) -> list[tuple[int, int, int]]:
    """(m, n, k) shapes: square, skinny (small m, or small k), small, and the lab model's own shapes.
    CPU sizes stop at 1024 (about 40 ms a call on one core); GPU sizes at 8192."""
    if on_gpu:
        square = [256, 512, 1024, 2048, 4096, 8192]
        skinny = [(1, 8192, 8192), (16, 8192, 8192), (128, 8192, 8192), (8192, 8192, 128), (8192, 128, 8192),
                  (4096, 14336, 4096), (4096, 4096, 1024)]
        small = [(64, 64, 64), (128, 128, 128), (32, 4096, 4096)]
    else:
        square = [16, 32, 64, 128, 256, 512, 1024]
        skinny = [(1, 1024, 1024), (8, 1024, 1024), (32, 512, 512), (512, 512, 8), (512, 512, 32),
                  (1024, 64, 1024), (128, 2048, 128)]
        small = [(8, 64, 64), (16, 128, 32), (64, 64, 256), (128, 256, 64), (128, 64, 256), (128, 128, 512)]
    shapes = [(s, s, s) for s in square] + skinny + small
    if quick:
        shapes = shapes[::3]
    return shapes


def memory_sizes(max_bytes: int, quick: bool = False) -> list[int]:
    """Element counts of the streaming sweep: 1 Ki ... up to a tensor of ``max_bytes`` / 4 fp32 elements, x 4."""
    sizes, n = [], 1024
    while n * 4 <= max_bytes:
        sizes.append(n)
        n *= 4 if not quick else 16
    return sizes


def collective_sizes(max_size: int, quick: bool = False) -> list[int]:
    """S in bytes: 1 KiB, 4 KiB, ... up to ``max_size`` (x 4; x 16 with ``quick``)."""
    sizes, s = [], 1024
    while s <= max_size:
        sizes.append(s)
        s *= 4 if not quick else 16
    return sizes


def free_memory_bytes(on_gpu: bool) -> int:
    """Free memory the sweep may use: the GPU's (``torch.cuda.mem_get_info``) or the host's MemAvailable."""
    if on_gpu:
        import torch

        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2 << 30


def default_max_size(on_gpu: bool, world_size: int, quick: bool = False) -> int:
    """The largest collective S a recording sweeps by default: 1 GiB on a GPU, 64 MiB on a CPU (gloo on
    loopback moves about 1 GB/s: larger sizes take minutes), 1 MiB with ``quick``; never more than the free
    memory / (8 x world_size) (input, output and the library's copies of every rank)."""
    cap = (1 << 30) if on_gpu else (64 << 20)
    if quick:
        cap = 1 << 20
    room = free_memory_bytes(on_gpu) // (8 * max(1, world_size))
    s = 1024
    while s * 4 <= min(cap, room):
        s *= 4
    return s


# ------------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------------
#: how repeated timings of one case become its ``seconds``: the fastest (the machine is shared: other
#: processes only ever add time, so the fastest repeat is the one least disturbed; calibration and validation
#: rows use the same statistic)
STATISTIC = "min"


def _stat(times) -> float:
    return float(min(times))


def _sync(device) -> None:
    if getattr(device, "type", "cpu") == "cuda":
        import torch

        torch.cuda.synchronize(device)


def time_call(fn, device, *, warmup: int = 2, repeats: int = 5, batch_s: float = 0.02, agree=None) -> float:
    """Seconds of one ``fn()`` call (:data:`STATISTIC` over batches): ``warmup`` calls, then ``repeats`` batches
    of calls sized to last about ``batch_s`` each (the first call's time decides the batch size, at most 10,000
    calls; ``agree(calls)``, when given, returns the count every rank uses: a collective must be called as
    often on every rank)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    one = max(time.perf_counter() - t0, 1e-7)
    calls = max(1, min(10_000, int(batch_s / one)))
    if agree is not None:
        calls = agree(calls)
    per = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        per.append((time.perf_counter() - t0) / calls)
    return _stat(per)


def _agree(ctx):
    """A function that returns the largest of every rank's call count (an all-reduce MAX)."""
    import torch
    import torch.distributed as dist

    def agree(calls: int) -> int:
        if ctx.world_size == 1:
            return calls
        t = torch.tensor([calls], dtype=torch.int64, device=ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())
    return agree


def _slowest(ctx, seconds: float) -> float:
    """The largest of every rank's ``seconds`` (an all-reduce MAX; the case is as slow as its slowest rank)."""
    import torch
    import torch.distributed as dist

    if ctx.world_size == 1:
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


# ------------------------------------------------------------------------------------------------------
# rank functions
# ------------------------------------------------------------------------------------------------------
def gemm_rank(ctx, shapes, dtypes=("float32",), *, repeats: int = 5, batch_s: float = 0.02) -> list[dict]:
    """Rank function: every (m, n, k) of ``shapes`` in every dtype, ``A[m, k] @ B[k, n]`` (2 m n k FLOPs, bytes
    (m k + k n + m n) e). Returns rows (kind, op, shape, dtype, bytes, flops, seconds) from rank 0, [] elsewhere."""
    import torch

    rows = []
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        e = torch.empty(0, dtype=dt).element_size()
        for m, n, k in shapes:
            a = torch.randn(m, k, device=ctx.device).to(dt)  # [m, k]
            b = torch.randn(k, n, device=ctx.device).to(dt)  # [k, n]
            ctx.barrier()
            s = _slowest(ctx, time_call(lambda a=a, b=b: torch.matmul(a, b), ctx.device, repeats=repeats,
                                        batch_s=batch_s, agree=_agree(ctx)))
            rows.append({"kind": "gemm", "op": "mm", "shape": f"{m}x{n}x{k}", "dtype": DTYPE_NAMES[dtype],
                         "bytes": (m * k + k * n + m * n) * e, "flops": 2 * m * n * k, "seconds": s})
    return rows if ctx.rank == 0 else []


def memory_rank(ctx, sizes, dtype: str = "float32", *, repeats: int = 5, batch_s: float = 0.02) -> list[dict]:
    """Rank function: ``torch.add(a, b, out=c)`` of n elements for every n of ``sizes`` (bytes 3 n e, n FLOPs)."""
    import torch

    dt = getattr(torch, dtype)
    e = torch.empty(0, dtype=dt).element_size()
    rows = []
    for n in sizes:
        a, b, c = (torch.ones(n, dtype=dt, device=ctx.device) for _ in range(3))  # [n] each
        ctx.barrier()
        s = _slowest(ctx, time_call(lambda a=a, b=b, c=c: torch.add(a, b, out=c), ctx.device, repeats=repeats,
                                    batch_s=batch_s, agree=_agree(ctx)))
        rows.append({"kind": "memory", "op": "add", "shape": str(n), "dtype": DTYPE_NAMES[dtype], "bytes": 3 * n * e,
                     "flops": n, "seconds": s})
    return rows if ctx.rank == 0 else []


def _collective(op: str, nbytes: int, ctx):
    """Buffers and a call for one collective of S = ``nbytes`` (fp32; nccl-tests convention for S)."""
    import torch
    import torch.distributed as dist

    from labkit.parallel.comm import all_gather_tensor, reduce_scatter_tensor

    n, r, dev = ctx.world_size, ctx.rank, ctx.device
    count = max(n, nbytes // 4 // n * n)  # elements of S, divisible by n
    if op == "all_reduce":
        x = torch.ones(count, device=dev)
        return lambda: dist.all_reduce(x)
    if op == "broadcast":
        x = torch.ones(count, device=dev)
        return lambda: dist.broadcast(x, src=0)
    if op == "all_gather":
        x, out = torch.ones(count // n, device=dev), torch.empty(count, device=dev)
        return lambda: all_gather_tensor(out, x)
    if op == "reduce_scatter":
        x, out = torch.ones(count, device=dev), torch.empty(count // n, device=dev)
        return lambda: reduce_scatter_tensor(out, x)
    if op == "all_to_all":
        x, out = torch.ones(count, device=dev), torch.empty(count, device=dev)
        return lambda: dist.all_to_all_single(out, x)
    if op == "send_recv":
        x, out = torch.ones(count, device=dev), torch.empty(count, device=dev)

        def call():
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (r + 1) % n),
                                             dist.P2POp(dist.irecv, out, (r - 1) % n)]):
                w.wait()
        return call
    raise ValueError(f"op={op!r} is not a recorded collective; choose from {', '.join(OPS)}")


def collective_rank(ctx, ops, sizes, *, repeats: int = 5, batch_s: float = 0.02) -> list[dict]:
    """Rank function: every op of ``ops`` at every S of ``sizes`` (bytes), one call between barriers per timing.
    An op the backend cannot run is one row with ``seconds`` empty and the error in ``note``."""
    rows = []
    for op in ops:
        for s in sizes:
            try:
                call = _collective(op, s, ctx)
                call()  # warm: the first call of an op may set up its algorithm
            except (RuntimeError, ValueError) as e:
                rows.append({"kind": "collective", "op": op, "shape": "", "dtype": "fp32", "bytes": s, "flops": 0,
                             "seconds": "", "note": f"not run: {str(e).splitlines()[0][:120]}"})
                break
            ctx.barrier()
            t = _slowest(ctx, time_call(call, ctx.device, warmup=1, repeats=repeats, batch_s=batch_s,
                                                agree=_agree(ctx)))
            rows.append({"kind": "collective", "op": op, "shape": "", "dtype": "fp32", "bytes": s, "flops": 0,
                         "seconds": t})
            del call
    return rows if ctx.rank == 0 else []


#: the traced training steps a recording times (model, micro-batch size, seq_len): one rank each, no
#: communication, a model the validated DP / TP / PP runs do not use (they run lab-tiny-llama)
#: and the number of micro-batches accumulated per step: as many tokens in more, smaller operations, so a fit
#: can tell the cost of an operation from the cost of its work
TRACE_RUNS = tuple(("lab-tiny-gpt", b, t, m) for b, t, m in ((2, 16, 1), (8, 16, 1), (1, 32, 4), (4, 32, 1),
                                                              (2, 64, 2), (8, 64, 1), (1, 128, 4), (4, 128, 1)))


def compress_trace(events) -> list[list]:
    """The compute events of a tracer's event list (``("c", t0, t1, flops, nbytes, dtype, ...)``) as
    ``[flops, nbytes, dtype, count]`` per distinct (flops, nbytes, dtype), sorted: what the emulator charges."""
    counts: dict[tuple, int] = {}
    for e in events:
        if e and e[0] == "c":
            key = (int(e[3]), int(e[4]), str(e[5]))
            counts[key] = counts.get(key, 0) + 1
    return [[f, b, d, n] for (f, b, d), n in sorted(counts.items())]


def trace_rank(ctx, runs=TRACE_RUNS, *, steps: int = 5, lr: float = 1e-3, trace: bool = True) -> list[dict]:
    """Rank function: for each (model, micro-batch size b, seq_len T, micro-batches m) of ``runs``, every rank
    trains its own copy of the model (no communication; all ranks at once, so each sees the load of the lab's
    runs): a step is m forward/backward passes of [b, T] tokens accumulated, then AdamW; ``steps`` steps timed
    after one warm-up; rank 0 then runs one more step under the emulator's tracer
    (:class:`labkit.runtime.emulate.tracer.Tracer`) and keeps its compute events (:func:`compress_trace`).
    Rows: kind ``trace``, op ``train_step``, shape ``<model> b<b> s<T> m<m>``, flops and bytes summed over the
    traced step, ``seconds`` (the fastest step, slowest rank: :data:`STATISTIC`) and ``trace`` (with
    ``trace=False`` only the timing: kind, op, shape, seconds)."""
    from labkit.models import SyntheticLM, build_model, lm_loss, make_optimizer
    from labkit.runtime.emulate.tracer import Tracer
    from labkit.theory.spec import get_spec

    rows = []
    for model, b, t, mb in runs:
        spec = get_spec(model)
        net = build_model(spec, 0, device=ctx.device)
        opt = make_optimizer(list(net.parameters()), lr)
        data = SyntheticLM(spec.vocab_size, t, 0)

        def step(i, net=net, opt=opt, data=data, b=b, mb=mb):
            opt.zero_grad(set_to_none=True)
            for j in range(mb):
                x, y = data.batch(i * mb + j, b)  # [b, T] each
                (lm_loss(net(x.to(ctx.device)), y.to(ctx.device)) / mb).backward()
            opt.step()

        step(0)
        ctx.barrier()
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            step(i + 1)
            _sync(ctx.device)
            times.append(time.perf_counter() - t0)
        sec = _slowest(ctx, _stat(times))
        if not trace:
            rows.append({"kind": "trace", "op": "train_step", "shape": f"{model} b{b} s{t} m{mb}", "seconds": sec})
        elif ctx.rank == 0:
            tracer = Tracer(0, 1).start()
            try:
                step(steps + 1)
            finally:
                ops = compress_trace(tracer.stop())
            rows.append({"kind": "trace", "op": "train_step", "shape": f"{model} b{b} s{t} m{mb}", "dtype": "fp32",
                         "bytes": sum(o[1] * o[3] for o in ops), "flops": sum(o[0] * o[3] for o in ops),
                         "seconds": sec, "trace": ops,
                         "note": f"{sum(o[3] for o in ops)} traced operations; {STATISTIC} of {steps} steps"})
        ctx.barrier()
    return rows


def step_seconds(spans: list[tuple[int, float]], skip: int = 1) -> float:
    """:data:`STATISTIC` over steps (after the first ``skip``) of one step's seconds, from (step, seconds) of
    every rank (a step lasts as long as its slowest rank)."""
    by_step: dict[int, float] = {}
    for step, s in spans:
        by_step[step] = max(by_step.get(step, 0.0), s)
    kept = [by_step[k] for k in sorted(by_step)][skip:] or list(by_step.values())
    if not kept:
        raise ValueError("no step spans were recorded")
    return _stat(kept)


class _StepTimer:
    """A ctx wrapper that times ``ctx.timer("step", ...)`` spans with the host clock (and forwards the rest)."""

    def __init__(self, ctx):
        self._ctx, self.spans = ctx, []

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def timer(self, name, *args, **tags):
        import contextlib

        inner = self._ctx.timer(name, *args, **tags)
        if name != "step":
            return inner

        @contextlib.contextmanager
        def span():
            t0 = time.perf_counter()
            with inner:
                yield
            self.spans.append((int(tags.get("step", 0)), time.perf_counter() - t0))
        return span()


def step_rank(ctx, run: str, *, steps: int = 4, **sizes) -> list[tuple[int, float]]:
    """Rank function: ``steps`` steps of run ``run`` (a :data:`STEP_RUNS` name) by
    :func:`labkit.experiments.emulate.step3d_rank` at :data:`STEP_DEFAULTS` (or ``sizes``); returns this rank's
    (step, seconds) of every ``step`` span."""
    from labkit.checks import check_choice
    from labkit.experiments.emulate import step3d_rank

    check_choice("run", run, STEP_RUNS)
    dp, tp, pp = STEP_RUNS[run]
    timed = _StepTimer(ctx)
    (step3d_rank if pp > 1 else flat_step_rank)(timed, dp, tp, pp, steps=steps, **{**STEP_DEFAULTS, **sizes})
    return timed.spans


def flat_step_rank(ctx, dp: int, tp: int, pp: int = 1, *, model: str = "lab-tiny-llama", seq_len: int = 32,
                   micro_batch_size: int = 1, n_microbatches: int = 4, steps: int = 2, lr: float = 1e-3,
                   seed: int = 0, data_seed: int = 0) -> dict:
    """Rank function: :func:`labkit.experiments.emulate.step3d_rank`'s step without a pipeline (pp = 1, which
    its 1F1B schedule cannot take): the same model, Megatron TP shard (:func:`labkit.parallel.tensor.apply_tp`
    over the TP group) and bucketed data parallelism (:class:`labkit.parallel.data.DataParallelBucket`, its
    all-reduces launched during the last micro-batch's backward), ``n_microbatches`` micro-batches of
    [micro_batch_size, seq_len] forward then backward, then AdamW; each step a ``ctx.timer("step")`` span.
    Returns ``{"losses": per step}``. Raises ValueError for pp != 1 or degrees that do not multiply to the
    world size."""
    import contextlib

    import torch.distributed as dist

    from labkit.models import SyntheticLM, build_model, make_optimizer, shard
    from labkit.parallel.data import DataParallelBucket
    from labkit.parallel.tensor import apply_tp
    from labkit.theory.mesh import ParallelDims
    from labkit.theory.spec import get_spec

    if pp != 1:
        raise ValueError(f"pp={pp!r}: flat_step_rank runs without a pipeline (pp=1); use step3d_rank for pp >= 2")
    dims = ParallelDims(ctx.world_size, dp=dp, tp=tp, pp=1)
    spec = get_spec(model)
    groups = {}
    for dim in ("tp", "dp"):
        for g in dims.groups(dim):
            pg = dist.new_group(g)
            if ctx.rank in g:
                groups[dim] = pg
    coords = dims.coords(ctx.rank)
    tpm = apply_tp(build_model(spec, seed, device=ctx.device), groups["tp"])
    dpm = DataParallelBucket(tpm, ctx=ctx, group=groups["dp"])
    opt = make_optimizer(list(tpm.parameters()), lr)
    data = SyntheticLM(spec.vocab_size, seq_len, data_seed)
    m = n_microbatches
    losses = []
    for step in range(steps):
        tokens, targets = data.batch(step, dp * micro_batch_size * m)  # [gbs, T]
        tokens, targets = shard(tokens, coords["dp"], dp), shard(targets, coords["dp"], dp)  # [mbs*m, T]
        ctx.barrier()
        total = 0.0
        with ctx.timer("step", step=step):
            opt.zero_grad(set_to_none=True)
            for mb in range(m):
                tags = {"step": step, "stage": 0, "microbatch": mb}
                with ctx.timer("F", **tags):
                    y = tpm.embed_tokens(shard(tokens, mb, m))  # [mbs, T, H]
                    for layer in tpm.layers:
                        y = layer(y)  # [mbs, T, H]
                    loss = tpm.loss(tpm.head(y), shard(targets, mb, m)) / m  # scalar
                    total += float(loss.detach())
                # accumulate locally until the last micro-batch, whose backward launches the buckets
                sync = contextlib.nullcontext() if mb == m - 1 else dpm.no_sync()
                with sync, ctx.timer("B", **tags):
                    loss.backward()
            dpm.finish_grad_sync()
            with ctx.timer("optimizer", "other", step=step):
                opt.step()
        losses.append(total)
    dpm.close()
    return {"losses": losses}


# ------------------------------------------------------------------------------------------------------
# running ranks: labkit.launch, or a small spawn runner on a bare python3 + torch
# ------------------------------------------------------------------------------------------------------
def full_launch_available() -> bool:
    """True when :func:`labkit.launch` can be imported (pandas and cloudpickle installed)."""
    try:
        import cloudpickle  # noqa: F401
        import pandas  # noqa: F401
    except ImportError:
        return False
    return True


def run_ranks(fn, world_size: int, *args, timeout_s: float = 600.0, **kwargs) -> list:
    """Every rank's return value of ``fn(ctx, *args, **kwargs)`` on ``world_size`` ranks: :func:`labkit.launch`
    (gloo on CPU, NCCL with a GPU per rank) when the lab is installed, else
    :func:`labkit.commands.record.spawn_ranks` (``fn`` must be a function of this module). Raises what
    the launcher raises (a LaunchError on a rank's failure or the timeout)."""
    if full_launch_available():
        from labkit.runtime.launcher import launch

        return list(launch(fn, world_size, *args, timeout_s=timeout_s, **kwargs))
    from labkit.commands.record import spawn_ranks

    return spawn_ranks(fn.__name__, world_size, *args, timeout_s=timeout_s, **kwargs)


# ------------------------------------------------------------------------------------------------------
# identity and writing
# ------------------------------------------------------------------------------------------------------
def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def identity(machine: str) -> dict:
    """Where and with what a recording was made: machine, device, host, torch, python, CUDA, git sha, time."""
    import torch

    on_gpu = torch.cuda.is_available()
    return {"machine": machine, "device": torch.cuda.get_device_name(0) if on_gpu else f"cpu ({cpu_name()})",
            "link": "nccl" if on_gpu and torch.cuda.device_count() > 1 else "gloo (loopback TCP)",
            "host": socket.gethostname(), "torch": torch.__version__, "python": platform.python_version(),
            "cuda": torch.version.cuda or "", "git_sha": _git_sha(), "cores": os.cpu_count() or 1,
            "recorded_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def finish_rows(rows: list[dict], ident: dict, world_size: int, threads: int) -> list[dict]:
    """Each row with the recording's identity columns and ``label`` ``measured (<machine>)`` (:data:`COLUMNS`)."""
    out = []
    for r in rows:
        full = {c: "" for c in COLUMNS}
        full.update({k: ident.get(k, "") for k in ("device", "link", "host", "torch", "python", "cuda", "git_sha",
                                                    "recorded_at")})
        full.update(world_size=world_size, threads=threads, label=f"measured ({ident['machine']})")
        full.update(r)
        out.append(full)
    return out


# ------------------------------------------------------------------------------------------------------
# labkit validate: the DP, TP and PP steps measured, and emulated on a profile
# ------------------------------------------------------------------------------------------------------
#: the band labkit validate's ``within`` column checks emulated / measured against (issue 26's goal)
VALIDATE_TOLERANCE = 0.15


def _frame_steps(frame) -> list[tuple[int, float]]:
    """(step, seconds) of every rank's ``step`` span in a timeline frame (measured or emulated)."""
    steps = frame[(frame["name"] == "step")]
    return [(int(s), (e - b) / 1e9) for s, b, e in zip(steps["step"], steps["start_ns"], steps["end_ns"])]


def validate_runs(profile: str, *, runs=tuple(STEP_RUNS), steps: int = 5, timeout_s: float = 300.0,
                  tolerance: float = VALIDATE_TOLERANCE, reprice: dict | None = None, **sizes) -> list[dict]:
    """The lab's DP, TP and PP steps (:func:`step_rank`, world size 2) run twice each through
    :func:`labkit.launch`: plainly (``measured_s``: the fastest step after the first, slowest rank, host clock)
    and emulated on ``profile`` (``emulated_s``: the same steps on the emulated clock of
    ``launch(..., emulate=profile)``). Returns one row per run: ``run``, ``world_size``, ``measured_s``,
    ``emulated_s``, ``ratio`` (emulated / measured), ``within`` (|ratio - 1| <= ``tolerance``) and the labels
    ``measured (this machine)`` / ``emulated (<profile>)``; with ``reprice`` ({name: profile}), ``repriced``:
    {name: the same emulated step on that profile} (the same traces replayed: :meth:`Emulation.reprice`).
    Raises ValueError for an unknown run or profile (before anything starts) and LaunchError when a launch
    fails."""
    from labkit.checks import check_choice
    from labkit.runtime.emulate import resolve
    from labkit.runtime.launcher import launch

    for r in runs:
        check_choice("run", r, STEP_RUNS)
    plan = resolve(profile, 2)
    label = getattr(plan, "label", None) or f"emulated ({plan.cluster.name})"
    out = []
    for run in runs:
        measured = [s for per in launch(step_rank, 2, run, steps=steps, timeout_s=timeout_s, **sizes) for s in per]
        res = launch(step_rank, 2, run, steps=steps, timeout_s=timeout_s, emulate=profile, **sizes)
        m, e = step_seconds(measured), step_seconds(_frame_steps(res.emulated))
        dp, tp, pp = STEP_RUNS[run]
        out.append({"run": run, "mesh": f"dp{dp} tp{tp} pp{pp}", "world_size": 2, "measured_s": m, "emulated_s": e,
                    "ratio": e / m, "within": abs(e / m - 1) <= tolerance, "measured_label": "measured (this machine)",
                    "emulated_label": label})
        if reprice:
            out[-1]["repriced"] = {k: step_seconds(_frame_steps(res.emulation.reprice(v).retime(res.timeline)))
                                   for k, v in reprice.items()}
    return out
