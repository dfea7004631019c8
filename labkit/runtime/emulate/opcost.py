"""What each aten operation costs, as the emulator's tracer records it (labkit.runtime.emulate.tracer): the
dispatch mode that sees every operation of a rank, the FLOP formulas of its matmuls and attention kernels
(torch.utils.flop_counter's registry for the rest), and the bytes each reads and writes. Split out of
tracer.py, which keeps the collectives, waits and the trace itself."""

from __future__ import annotations

import re
import threading
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from labkit.runtime import timeline as _timeline
from labkit.runtime.timeline import now_ns

#: dispatch-level c10d op -> canonical op, for collectives issued from C++
_C10D = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "allgather_": "all_gather",
         "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
         "allgather_coalesced_": "all_gather", "reduce_scatter_": "reduce_scatter",
         "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
         "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "broadcast_": "broadcast",
         "reduce_": "broadcast", "gather_": "all_gather", "scatter_": "all_gather", "barrier": "barrier"}
_FUNCTIONAL = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
               "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
               "all_gather_into_tensor_out": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
               "reduce_scatter_tensor_coalesced": "reduce_scatter", "all_to_all_single": "all_to_all",
               "broadcast": "broadcast", "broadcast_": "broadcast"}


_FREE_OPS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense",
             "lift_fresh", "set_", "resize_", "detach", "alias", "_to_copy_meta", "is_same_size", "sym_size",
             "sym_stride", "sym_numel", "_has_compatible_shallow_copy_type", "record_stream"}
_PLAIN = (torch.Tensor, torch.nn.Parameter)
#: aten operations with no FLOP formula whose work is not their memory traffic: charged by bytes, listed unpriced
_UNPRICED = re.compile(r"^_?(linalg_|cholesky|triangular_solve|fft_|_fft|lu|svd|qr|geqrf|ormqr|eig|symeig|inverse"
                       r"|det|slogdet|logdet|lstsq|matrix_exp|matrix_power|cdist|pdist|_cdist|_pdist|orgqr)")
_SDPA_CPU = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")


def _tensors(x, out: list) -> None:
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            if isinstance(y, torch.Tensor):
                out.append(y)
            elif isinstance(y, (list, tuple)):
                _tensors(y, out)


_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
           torch.float16: "float16"}
#: the timeline clock's test skew (labkit.runtime.timeline.now_ns adds it), added to the fast path's readings
_SKEW = _timeline._TEST_CLOCK_SKEW_NS
_cpu_ns = time.thread_time_ns
#: main-thread CPU time between two traced events above which the gap is host work the tracer cannot price
#: (numpy, Python loops): recorded as ``("u", t0, t1, "host", cpu_ns)``. CPU time, not wall time, so a rank
#: descheduled on a loaded machine is not mistaken for one that works outside torch. 1 ms: torch's own host
#: path between two operations (autograd.Function frames, c10d's Python API, tensor frees) and the machine's
#: noise are far below it and rarely reach it — measured in chapter 07's 4-rank ring (2,400 gaps a rank, all
#: torch, 2 vCPUs): median 40 µs, p99 0.38-0.49 ms, max 1.4-2.3 ms; gaps above 0.2 ms (the old threshold)
#: summed to 3-6.5 % of a rank's span and labelled a torch-only run incomplete, above 1 ms to at most 1.4 ms.
HOST_GAP_CPU_NS = 1_000_000


def _mm(args, kwargs, out) -> tuple:  # a [m, k] @ b [k, n]: 2mkn, GEMM shape (1, m, n, k)
    a, b = args[0].shape, args[1].shape
    return 2 * a[0] * a[1] * b[1], (1, a[0], b[1], a[1])


def _addmm(args, kwargs, out) -> tuple:  # bias + a [m, k] @ b [k, n]: 2mkn (the matmul, as torch counts it)
    a, b = args[1].shape, args[2].shape
    return 2 * a[0] * a[1] * b[1], (1, a[0], b[1], a[1])


def _bmm(args, kwargs, out) -> tuple:  # a [B, m, k] @ b [B, k, n]: 2Bmkn, GEMM shape (B, m, n, k)
    a, b = args[0].shape, args[1].shape
    return 2 * a[0] * a[1] * a[2] * b[2], (a[0], a[1], b[2], a[2])


def _baddbmm(args, kwargs, out) -> tuple:
    a, b = args[1].shape, args[2].shape
    return 2 * a[0] * a[1] * a[2] * b[2], (a[0], a[1], b[2], a[2])


#: the matmul FLOP formulas of torch.utils.flop_counter (mm_flop, addmm_flop, bmm_flop, baddbmm_flop), on shapes
#: directly: the registry's wrappers map over every argument, which costs more than the operation at lab sizes
_MATMUL = {"mm": _mm, "addmm": _addmm, "bmm": _bmm, "baddbmm": _baddbmm}


def _registry_flops(formula):
    """torch.utils.flop_counter's formula (called as FlopCounterMode calls it), or None."""
    if formula is None:
        return None
    return lambda args, kwargs, out: formula(*args, **kwargs, out_val=out)


def _sdpa_flops(name: str, args, kwargs=None) -> tuple:
    """(FLOPs, attention shape or None) of the CPU flash-attention kernels, with torch's formulas for the fused
    attention kernels (grouped kv heads broadcast to the query heads, as the kernel does). The forward's shape
    is ``(batch, heads, q_len, kv_len, head_dim, causal)`` (q [B, H, L, D], k [B, Hkv, S, D]); the backward has
    none (priced by its FLOPs)."""
    try:
        if name.endswith("_backward"):
            g, q, k, v = (tuple(a.shape) for a in args[:4])
            k, v = (k[0], q[1], k[2], k[3]), (v[0], q[1], v[2], v[3])
            return int(sdpa_backward_flop_count(g, q, k, v)), None
        q, k, v = (tuple(a.shape) for a in args[:3])
        causal = bool(args[4]) if len(args) > 4 else bool((kwargs or {}).get("is_causal", False))
        return int(sdpa_flop_count(q, k, v)), (q[0], q[1], q[2], k[2], q[3], causal)
    except Exception:  # noqa: BLE001 - an unexpected shape: count the bytes only
        return 0, None


class _Mode(TorchDispatchMode):
    """The dispatch mode that prices compute and sees functional and C++-issued collectives."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in torch._disable_dynamo by default, which imports
        # torch._dynamo on the first operation (seconds) and adds a wrapper to every one; nothing is compiled
        # under this mode (torch.compile'd code is not emulatable), so skip it
        return False

    def __init__(self, tracer):  # a labkit.runtime.emulate.tracer.Tracer
        super().__init__()
        self.tracer = tracer
        self.cache: dict = {}
        try:
            from torch._subclasses.fake_tensor import FakeTensor

            self.fake = FakeTensor
        except ImportError:  # pragma: no cover
            self.fake = None

    def _kind(self, func):
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns == "c10d":
            k = ("c10d", _C10D.get(name))
        elif ns in ("_c10d_functional", "_c10d_functional_autograd"):
            k = ("wait",) if name == "wait_tensor" else ("functional", _FUNCTIONAL.get(name))
        elif ns in ("profiler", "prim") or getattr(func, "is_view", False) or name in _FREE_OPS:  # prim: metadata
            k = ("free",)
        elif name in _SDPA_CPU:
            k = ("sdpa", name)
        elif name in _MATMUL:
            k = ("op", _MATMUL[name], "gemm")
        else:
            formula = _registry_flops(flop_registry.get(func._overloadpacket))
            unpriced = formula is None and bool(_UNPRICED.match(name))
            k = ("op", formula, "other" if formula is not None else "unpriced" if unpriced else "memory")
        self.cache[id(func)] = (func, k)  # keep func alive: its id is the key
        return k

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in types:
            if t is not torch.Tensor and t is not torch.nn.Parameter:
                if self.fake is not None and issubclass(t, self.fake):
                    return func(*args, **kwargs)
                return NotImplemented  # a tensor subclass: its own dispatch runs, its local ops come back here
        entry = self.cache.get(id(func))
        tr = self.tracer
        if entry is not None:
            k = entry[1]
        else:  # the tracer's own first look at an operation is not the program's host work
            c = _cpu_ns()
            k = self._kind(func)
            tr.cpu_mark += _cpu_ns() - c
        kind = k[0]
        if kind == "free" and not tr.depth and threading.get_ident() == tr.main:
            c = _cpu_ns()  # torch's own dispatch of a view (slow under fake tensors) is not host work outside torch
            out = func(*args, **kwargs)
            tr.cpu_mark += _cpu_ns() - c
            return out
        if kind == "free" or tr.depth or threading.get_ident() != tr.main:
            return func(*args, **kwargs)
        if kind == "op" or kind == "sdpa":
            c0 = _cpu_ns()
            t0 = time.monotonic_ns()
            if c0 - tr.cpu_mark > HOST_GAP_CPU_NS:
                tr.events.append(("u", tr.wall_mark, t0 + _SKEW, "host", c0 - tr.cpu_mark))
            out = func(*args, **kwargs)
            t1 = time.monotonic_ns()
            nbytes, dtype, ins = 0, None, []
            for a in args:
                if isinstance(a, torch.Tensor):
                    ins.append(a)
                elif isinstance(a, (list, tuple)):
                    _tensors(a, ins)
            if kwargs:
                for v in kwargs.values():
                    _tensors(v, ins)
            for a in ins:
                nbytes += a.numel() * a.element_size()
                if dtype is None and a.is_floating_point():
                    dtype = a.dtype
            if isinstance(out, torch.Tensor):
                outs = (out,)
            else:
                outs = []
                _tensors(out, outs)
            for o in outs:
                if not any(o is a for a in ins):
                    nbytes += o.numel() * o.element_size()
                    if dtype is None and o.is_floating_point():
                        dtype = o.dtype
            flops, shape = 0, None
            if kind == "sdpa":
                flops, shape = _sdpa_flops(k[1], args, kwargs)
                ok = "attention" if shape is not None else "other"
            else:
                ok = k[2]
                if k[1] is not None:
                    try:
                        f = k[1](args, kwargs, out)
                        flops, shape = (int(f[0]), f[1]) if ok == "gemm" else (int(f), None)
                    except Exception:  # noqa: BLE001 - a formula that does not fit these arguments: bytes only
                        flops, shape, ok = 0, None, "unpriced"
            if tr.in_backward and tr.backward_pending and tr.pending_bufs:
                tr.reducer_waits(ins, t0 + _SKEW)
            if ok == "unpriced":
                tr.events.append(("u", t0 + _SKEW, t1 + _SKEW, func._schema.name.split("::")[-1]))
                ok = "memory"
            if flops or nbytes:
                tr.events.append(("c", t0 + _SKEW, t1 + _SKEW, flops, nbytes, _DTYPES.get(dtype, "float32"), ok,
                                  shape))
            if tr.pending_bufs:
                tr.check_use(ins, t0 + _SKEW, t1 + _SKEW)
            tr.wall_mark, tr.cpu_mark = t1 + _SKEW, _cpu_ns()
            return out
        if kind == "c10d":
            return tr.c10d_op(func, k[1], args, kwargs)
        if kind == "functional":
            return tr.functional_op(func, k[1], args, kwargs)
        # wait_tensor
        t0 = now_ns()
        out = func(*args, **kwargs)
        uid = tr.tensor_uids.pop(id(args[0]), (None,))[0] if args else None
        if uid is not None:
            tr.record_waits((uid,), t0, now_ns())
        return out
