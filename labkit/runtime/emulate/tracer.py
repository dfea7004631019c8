"""Inside a rank: record the program's own sequence of events for the emulator (the trace format of
:mod:`labkit.theory.replay`). Imports torch; the launcher's worker starts a :class:`Tracer` around the rank
function when ``launch(..., emulate=...)`` is given, and ships ``tracer.stop()`` back with the result.

What is observed, and how (every path is exercised by tests/test_emulate.py):

* **compute** — a ``TorchDispatchMode`` sees every aten operation of the rank's main thread: FLOPs from
  ``torch.utils.flop_counter``'s formula registry (mm, addmm, bmm, baddbmm, convolutions, the attention
  kernels; plus the CPU flash-attention kernels, counted with the same formulas), bytes = the sum of the
  input and output tensors' sizes (``numel * element_size``; outputs that are an input, as in in-place ops,
  counted once): an upper bound of the memory traffic. Views, factory functions that only allocate
  (``empty*``) and bookkeeping ops cost nothing. Operations on tensor subclasses (DTensor, FSDP2's,
  AsyncCollectiveTensor) are handed to the subclass (``NotImplemented``), whose local operations are then seen.
* **time.sleep(s)** on the main thread — ``s`` seconds of compute (a stand-in for that much work).
* **collectives and p2p** through ``torch.distributed`` — the functions of ``torch.distributed`` and
  ``torch.distributed.distributed_c10d`` are wrapped (so torch's own helpers, e.g. ``batch_isend_irecv``
  and the object collectives, are seen too): op, the group's global ranks, S in the nccl-tests convention
  (as :mod:`labkit.runtime.commlog` counts it), async or blocking, peer and tag, and the process group's
  identity (``info["pg"]``: the index, in creation order, of this group among the groups with the same
  members, so two groups of the same ranks are two streams).
* **waits** — every way torch lets a program wait for async work: ``Work.wait()`` / ``Work.synchronize()``,
  ``Work.get_future()`` futures (``torch._C.Future``: ``wait()``, ``value()``, and the futures ``then()``
  chains, which complete after the work), ``torch.futures.wait_all`` / ``collect_all``, polling
  (``Work.is_completed()`` / ``Future.done()`` returning True: the program has seen the work end),
  ``wait_tensor`` of functional collectives, and where CUDA runs ``torch.cuda.synchronize`` /
  ``Stream.synchronize`` / ``Event.synchronize`` (every outstanding async op of the rank).
* **consumed early** — an operation that reads the buffer of an ``irecv`` (or of an async collective) before
  the program waited for it is recorded (``("use", t0, t1, uid)``): the replay flags it a dependency
  violation when the emulated transfer had not ended. Inside a backward pass, reading the bucket of a DDP comm
  hook's all-reduce is DDP's reducer, which waits for that bucket first: a wait, not a violation.
* **what it cannot price** — aten operations with no FLOP formula that are not memory-bound (linear algebra
  decompositions, FFTs, distance kernels) are charged by their bytes and recorded with their measured time
  (``("u", t0, t1, name)``); host work outside torch (numpy, Python loops) is main-thread CPU time between
  two traced events above :data:`HOST_GAP_CPU_NS`, recorded as ``("u", t0, t1, "host", cpu_ns)``.
* **functional collectives** (DTensor: ``torch.ops._c10d_functional.*``) — seen in the dispatch mode, async,
  waited at ``wait_tensor``.
* **collectives issued from C++** (DDP's reducer without a comm hook, DDP's construction) — seen in the
  dispatch mode as ``c10d`` ops: inside a backward pass they are asynchronous and waited when the backward
  returns (DDP's reducer waits for every bucket at the end of backward: ``finalize_backward``); elsewhere
  blocking. The futures a DDP comm hook returns are waited at the same point.

A collective issued from another thread than the one that runs the rank function raises RuntimeError (the
dispatch mode cannot see that thread's compute, so its timeline would be wrong), and so does ``torch.compile``
(compiled graphs hide their operations): a variant that cannot be emulated says so.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time

import torch
import torch.distributed as dist

from labkit.parallel.comm import nbytes
from labkit.runtime.emulate import state
from labkit.runtime.emulate.opcost import HOST_GAP_CPU_NS, _cpu_ns, _Mode, _tensors
from labkit.runtime.timeline import now_ns

#: torch.distributed function -> (canonical op, kind). Ops priced by another op's formula: reduce like
#: broadcast (a pipelined chain), gather and scatter like all_gather (the same (n-1)/n volume).
FUNCTIONS = {
    "all_reduce": ("all_reduce", "coll"), "all_reduce_coalesced": ("all_reduce", "coll"),
    "all_gather": ("all_gather", "coll"), "all_gather_into_tensor": ("all_gather", "coll"),
    "all_gather_single": ("all_gather", "coll"), "_all_gather_base": ("all_gather", "coll"),
    "all_gather_coalesced": ("all_gather", "coll"),
    "reduce_scatter": ("reduce_scatter", "coll"), "reduce_scatter_tensor": ("reduce_scatter", "coll"),
    "reduce_scatter_single": ("reduce_scatter", "coll"), "_reduce_scatter_base": ("reduce_scatter", "coll"),
    "all_to_all": ("all_to_all", "coll"), "all_to_all_single": ("all_to_all", "coll"),
    "broadcast": ("broadcast", "coll"), "reduce": ("broadcast", "coll"),
    "gather": ("all_gather", "coll"), "scatter": ("all_gather", "coll"),
    "barrier": ("barrier", "coll"), "monitored_barrier": ("barrier", "coll"),
    "send": ("send", "p2p"), "recv": ("recv", "p2p"), "isend": ("send", "p2p"), "irecv": ("recv", "p2p"),
}
#: the argument that holds S for each canonical op (nccl-tests convention: labkit.runtime.commlog)
_S_ARGS = {
    "all_gather": ("output_tensor", "tensor_list", "output_tensor_lists", "gather_list"),
    "reduce_scatter": ("input", "input_list"),
    "all_to_all": ("input", "input_tensor_list"),
}


class Tracer:
    """Records one rank's trace while active (module docstring). ``start()`` patches and pushes the dispatch
    mode; ``stop()`` undoes everything and returns the event list. One Tracer per process at a time."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = int(rank), int(world_size)
        self.events: list[tuple] = []
        self.depth = 0
        self.main = threading.get_ident()
        self._uid = 0
        self.works: dict[int, tuple] = {}  # id(Work) -> (uid, work)
        self.futures: dict[int, tuple] = {}  # id(Future) -> (uids, future)
        self.tensor_uids: dict[int, tuple] = {}  # id(functional collective output) -> (uid, tensor)
        self.in_backward = 0
        self.backward_pending: list[int] = []
        self.hook_depth = 0
        self.in_callback = 0  # inside a Future.then callback on the main thread
        self.nbytes_override: int | None = None
        # end of the last traced event (no gap before the first: the rank function's start-up is not work)
        self.wall_mark, self.cpu_mark = now_ns(), float("inf")
        self._poll_t0: dict[int, int] = {}  # uid -> when the program first polled it
        self.outstanding: dict[int, None] = {}  # uids of async work not yet waited (insertion order)
        self.pending_bufs: dict[int, int] = {}  # storage ptr of an async recv / collective buffer -> uid
        self._buf_of: dict[int, list] = {}  # uid -> its buffers' storage ptrs
        self._pg_index: dict[int, tuple] = {}  # id(process group) -> (index among same-member groups, group)
        self._saved: list[tuple] = []
        self._mode: _Mode | None = None
        self._sigs: dict = {}

    # -- lifecycle ------------------------------------------------------------------------------------------
    def _patch(self, obj, name, value) -> None:
        self._saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def start(self) -> Tracer:
        if state.ACTIVE is not None:
            raise RuntimeError("another emulation tracer is already active in this process")
        c10d = dist.distributed_c10d
        for name in FUNCTIONS:
            orig = getattr(c10d, name, None)
            if orig is None:
                continue
            w = self._wrap(name, orig)
            self._patch(c10d, name, w)
            if getattr(dist, name, None) is orig:
                self._patch(dist, name, w)
        self._patch(dist.Work, "wait", self._work_wait(dist.Work.wait))
        self._patch(dist.Work, "synchronize", self._work_wait(dist.Work.synchronize))
        self._patch(dist.Work, "is_completed", self._work_poll(dist.Work.is_completed))
        self._patch(dist.Work, "get_future", self._work_future(dist.Work.get_future))
        # torch's fake process group (fake-tensor runs) returns FakeWork, which overrides wait (and getFuture)
        fake_work = getattr(torch._C._distributed_c10d, "FakeWork", None)
        if fake_work is not None and "wait" in vars(fake_work):
            self._patch(fake_work, "wait", self._work_wait(fake_work.wait))
        fut = torch._C.Future  # Work.get_future() returns this base class; torch.futures.Future derives from it
        self._patch(fut, "wait", self._future_wait(fut.wait))
        self._patch(fut, "value", self._future_wait(fut.value))
        self._patch(fut, "done", self._future_poll(fut.done))
        self._patch(fut, "then", self._future_then(fut.then))
        self._patch(torch.futures, "collect_all", self._collect_all(torch.futures.collect_all))
        self._patch(torch.futures, "wait_all", self._wait_all(torch.futures.wait_all))
        if torch.cuda.is_available():  # stream waits: everything outstanding (guarded: CPU-only torch has none)
            self._patch(torch.cuda, "synchronize", self._wait_everything(torch.cuda.synchronize))
            self._patch(torch.cuda.Stream, "synchronize", self._wait_everything(torch.cuda.Stream.synchronize))
            self._patch(torch.cuda.Event, "synchronize", self._wait_everything(torch.cuda.Event.synchronize))
        self._patch(time, "sleep", self._sleep(time.sleep))
        self._patch(torch.autograd, "backward", self._backward(torch.autograd.backward))
        self._patch(torch.autograd, "grad", self._backward(torch.autograd.grad))
        from torch.nn.parallel import DistributedDataParallel as DDP

        self._patch(DDP, "register_comm_hook", self._ddp_hook(DDP.register_comm_hook))
        self._patch(torch, "compile", _no_compile)
        self._mode = _Mode(self)
        self._mode.__enter__()
        state.ACTIVE = self
        return self

    def stop(self) -> list[tuple]:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for obj, name, value in reversed(self._saved):
            setattr(obj, name, value)
        self._saved.clear()
        if state.ACTIVE is self:
            state.ACTIVE = None
        self.works.clear()
        self.futures.clear()
        self.tensor_uids.clear()
        self.pending_bufs.clear()
        self._buf_of.clear()
        self._pg_index.clear()
        self._poll_t0.clear()
        return self.events

    def uid(self) -> int:
        self._uid += 1
        return self._uid

    def _info(self, name: str) -> dict:
        info = {"name": name}
        tr = sys.modules.get("labkit.runtime.training")
        if tr is not None and getattr(tr.CURRENT, "step", -1) >= 0:
            info["step"], info["microbatch"] = tr.CURRENT.step, tr.CURRENT.microbatch
        return info

    def _ranks(self, group) -> tuple:
        if group is None or group is dist.GroupMember.WORLD:
            return tuple(range(self.world_size))
        return tuple(sorted(dist.get_process_group_ranks(group)))

    def _pg(self, group, ranks: tuple) -> int:
        """The group's identity beside its members: its index, in creation order, among this process's groups
        with the same members (0 for the first; torch requires every member to create groups in one order)."""
        if group is None or group is dist.GroupMember.WORLD:
            return 0
        hit = self._pg_index.get(id(group))
        if hit is not None and hit[1] is group:
            return hit[0]
        j = 0
        try:
            for pg in dist.distributed_c10d._world.pg_map:
                if pg is group:
                    break
                if pg is not dist.GroupMember.WORLD and tuple(sorted(dist.get_process_group_ranks(pg))) == ranks:
                    j += 1
        except Exception:  # noqa: BLE001 - an unregistered group: the first of its members
            j = 0
        self._pg_index[id(group)] = (j, group)
        return j

    def _check_thread(self, what: str) -> None:
        if threading.get_ident() != self.main:
            raise RuntimeError(f"{what} was issued from a thread other than the rank's main thread; emulation "
                               "sees only the main thread's compute, so this run cannot be emulated (issue "
                               "collectives from the thread that runs the rank function)")

    # -- torch.distributed functions ----------------------------------------------------------------------------
    def _wrap(self, name: str, fn):
        op, kind = FUNCTIONS[name]
        sig = inspect.signature(fn)

        def wrapper(*args, **kwargs):
            if self.depth:
                return fn(*args, **kwargs)
            c_in = _cpu_ns()  # this call's own bookkeeping, before and after the call, is not host work
            self._check_thread(f"dist.{name}")
            try:
                a = sig.bind(*args, **kwargs).arguments
            except TypeError:
                return fn(*args, **kwargs)  # let torch raise its own error
            group = a.get("group")
            if group is dist.GroupMember.NON_GROUP_MEMBER:
                return fn(*args, **kwargs)
            self.depth += 1
            t0 = now_ns()
            self.gap(t0, c_in)
            try:
                out = fn(*args, **kwargs)
            finally:
                t1 = now_ns()
                self.depth -= 1
                self.mark(t1)
            is_async = bool(a.get("async_op", False)) or name in ("isend", "irecv")
            uid = self.uid()
            info = self._info(op if kind == "coll" else name.lstrip("i"))
            if kind == "coll":
                ranks = self._ranks(group)
                if self.rank in ranks:
                    s = 0 if op == "barrier" else self._payload(op, a)
                    if self.nbytes_override is not None and op != "barrier":
                        s = self.nbytes_override
                    pg = self._pg(group, ranks)
                    if pg:
                        info["pg"] = pg
                    self.events.append(("coll", t0, t1, uid, op, ranks, s, is_async, info))
            else:
                peer = self._peer(op, a, group, out)
                s = nbytes(a.get("tensor")) if self.nbytes_override is None else self.nbytes_override
                self.events.append(("p2p", t0, t1, uid, op, peer, int(a.get("tag", 0) or 0), s, is_async, info))
            if is_async and out is not None:
                self._remember(out, uid)
                self.outstanding[uid] = None
                if op != "send" and op != "barrier":  # what the program must not read before it waits
                    self._track(uid, a.get("tensor", a.get("output_tensor", a.get("output"))))
            if self.in_backward and self.hook_depth and is_async:
                self.backward_pending.append(uid)
            self.mark(t1)
            return out

        wrapper._labkit_emulate = True
        wrapper.__wrapped__ = fn
        wrapper.__name__ = getattr(fn, "__name__", name)
        return wrapper

    def _payload(self, op: str, a: dict) -> int:
        for key in _S_ARGS.get(op, ()):
            if a.get(key) is not None:
                return nbytes(a[key])
        if op in ("all_gather",) and "tensor" in a:  # gather without a list on this rank
            return nbytes(a["tensor"]) * self.world_size
        return nbytes(a.get("tensor", a.get("tensors", a.get("input_tensor"))))

    def _peer(self, op: str, a: dict, group, out):
        key, gkey = ("dst", "group_dst") if op == "send" else ("src", "group_src")
        if a.get(key) is not None:
            return int(a[key])
        if a.get(gkey) is not None:
            return int(dist.get_global_rank(group, a[gkey]))
        if op == "recv" and isinstance(out, int) and out >= 0:
            return out  # a blocking recv from any source returns the rank it heard from
        return -1

    def _remember(self, work, uid: int) -> None:
        if isinstance(work, (list, tuple)):
            for w in work:
                self._remember(w, uid)
            return
        self.works[id(work)] = (uid, work)

    # -- waits ---------------------------------------------------------------------------------------------------
    def gap(self, t0: int, c: int | None = None) -> None:
        """Before a traced event starting at ``t0`` (the tracer's own work on it began at CPU time ``c``,
        default now): record the host CPU work since the last one if above :data:`HOST_GAP_CPU_NS`."""
        c = _cpu_ns() if c is None else c
        if c - self.cpu_mark > HOST_GAP_CPU_NS and threading.get_ident() == self.main:
            self.events.append(("u", self.wall_mark, t0, "host", c - self.cpu_mark))
            self.cpu_mark = c

    def mark(self, t1: int) -> None:
        """After a traced event ending at ``t1``."""
        if threading.get_ident() == self.main:
            self.wall_mark, self.cpu_mark = t1, _cpu_ns()

    def record_waits(self, uids, t0: int, t1: int) -> None:
        """The main thread waited (t0..t1) for the async events ``uids``: one ``wait`` event each."""
        if threading.get_ident() != self.main:
            return
        self.gap(t0)
        for uid in uids:
            self.events.append(("wait", t0, t1, uid))
            self.outstanding.pop(uid, None)
            for ptr in self._buf_of.pop(uid, ()):
                if self.pending_bufs.get(ptr) == uid:
                    del self.pending_bufs[ptr]
        self.mark(t1)

    def _uids_of_future(self, fut) -> tuple:
        entry = self.futures.get(id(fut))
        return entry[0] if entry is not None and entry[1] is fut else ()

    def _track(self, uid: int, tensor) -> None:
        ts: list = []
        _tensors(tensor, ts)
        ptrs = []
        for t in ts:
            try:
                p = t.untyped_storage().data_ptr()
            except Exception:  # noqa: BLE001 - a tensor without storage (a subclass): not tracked
                continue
            if p:
                self.pending_bufs[p] = uid
                ptrs.append(p)
        if ptrs:
            self._buf_of[uid] = ptrs

    def reducer_waits(self, ins: list, t0: int) -> None:
        """Inside a backward pass, an operation about to read the buffer of async work issued in that backward
        (a DDP comm hook's bucket all-reduce): DDP's reducer waits for each bucket's future before it copies the
        bucket out (``finalize_backward``, in C++ where no Python wait is seen), so this is a wait at ``t0``,
        recorded before the operation, not a read of unfinished data."""
        for a in ins:
            try:
                p = a.untyped_storage().data_ptr()
            except Exception:  # noqa: BLE001
                continue
            uid = self.pending_bufs.get(p)
            if uid is not None and uid in self.backward_pending:
                self.backward_pending.remove(uid)
                self.record_waits((uid,), t0, t0)

    def check_use(self, ins: list, t0: int, t1: int) -> None:
        """An operation read ``ins``: a buffer of async work not yet waited is consumed before it completes."""
        for a in ins:
            try:
                p = a.untyped_storage().data_ptr()
            except Exception:  # noqa: BLE001
                continue
            uid = self.pending_bufs.pop(p, None)
            if uid is not None:
                self.events.append(("use", t0, t1, uid))

    def _work_wait(self, orig):
        tracer = self

        def wait(work, *args, **kwargs):
            t0 = now_ns()
            out = orig(work, *args, **kwargs)
            entry = tracer.works.get(id(work))
            if entry is not None:
                tracer.record_waits((entry[0],), t0, now_ns())
            return out

        return wait

    def _work_poll(self, orig):
        tracer = self

        def is_completed(work, *args, **kwargs):
            t0 = now_ns()
            done = orig(work, *args, **kwargs)
            entry = tracer.works.get(id(work))
            if entry is not None and entry[0] in tracer.outstanding:
                first = tracer._poll_t0.setdefault(entry[0], t0)  # a polling loop is one wait, from its first poll
                if done:
                    tracer.cpu_mark = _cpu_ns() if first != t0 else tracer.cpu_mark
                    tracer.record_waits((entry[0],), first, now_ns())  # the program has seen it end: a wait
                    tracer._poll_t0.pop(entry[0], None)
            return done

        return is_completed

    def _work_future(self, orig):
        tracer = self

        def get_future(work, *args, **kwargs):
            fut = orig(work, *args, **kwargs)
            entry = tracer.works.get(id(work))
            if entry is not None:
                tracer.futures[id(fut)] = ((entry[0],), fut)
            return fut

        return get_future

    def _future_wait(self, orig):
        tracer = self

        def wait(fut, *args, **kwargs):
            t0 = now_ns()
            out = orig(fut, *args, **kwargs)
            uids = tracer._uids_of_future(fut) if not tracer.in_callback else ()
            if uids:
                tracer.record_waits(uids, t0, now_ns())
            return out

        wait.__name__ = getattr(orig, "__name__", "wait")
        return wait

    def _future_poll(self, orig):
        tracer = self

        def done(fut, *args, **kwargs):
            t0 = now_ns()
            out = orig(fut, *args, **kwargs)
            uids = tracer._uids_of_future(fut) if out and not tracer.in_callback else ()
            if uids and any(u in tracer.outstanding for u in uids):
                tracer.record_waits(uids, t0, now_ns())
            return out

        return done

    def _future_then(self, orig):
        tracer = self

        def then(fut, callback, *args, **kwargs):
            def traced_callback(f):
                # a callback runs once its future is complete: the value() or wait() it calls is no wait of the
                # program's. It runs inline on the main thread when the work had already ended (else on the
                # backend's thread): counting it would make the trace depend on timing.
                main = threading.get_ident() == tracer.main
                tracer.in_callback += main
                try:
                    return callback(f)
                finally:
                    tracer.in_callback -= main

            out = orig(fut, traced_callback, *args, **kwargs)
            uids = tracer._uids_of_future(fut)
            if uids:  # the chained future completes after the work (and the callback): waiting on it waits on it
                tracer.futures[id(out)] = (uids, out)
            return out

        return then

    def _collect_all(self, orig):
        tracer = self

        def collect_all(futures):
            out = orig(futures)
            uids = tuple(u for f in futures for u in tracer._uids_of_future(f))
            if uids:
                tracer.futures[id(out)] = (uids, out)
            return out

        collect_all.__wrapped__ = orig
        return collect_all

    def _wait_all(self, orig):
        tracer = self

        def wait_all(futures):
            t0 = now_ns()
            out = orig(futures)
            uids = tuple(u for f in futures for u in tracer._uids_of_future(f))
            if uids:
                tracer.record_waits(uids, t0, now_ns())
            return out

        wait_all.__wrapped__ = orig
        return wait_all

    def _wait_everything(self, orig):
        tracer = self

        def synchronize(*args, **kwargs):
            t0 = now_ns()
            out = orig(*args, **kwargs)
            tracer.record_waits(tuple(tracer.outstanding), t0, now_ns())
            return out

        synchronize.__wrapped__ = orig
        return synchronize

    # -- dispatch-level collectives ---------------------------------------------------------------------------
    def c10d_op(self, func, op, args, kwargs):
        """A c10d op no Python wrapper saw: issued from C++ (DDP's reducer, DDP's construction)."""
        t0 = now_ns()
        out = func(*args, **kwargs)
        t1 = now_ns()
        if op is None:
            return out
        pg = next((a for a in args if type(a).__name__ == "ProcessGroup"), None)
        try:
            ranks = self._ranks(pg)
        except Exception:  # noqa: BLE001 - an unregistered group: the world
            ranks = tuple(range(self.world_size))
        # S as nccl-tests counts it: the (gathered) output's first argument, reduce-scatter's input (the second)
        s = 0 if op == "barrier" else nbytes(args[1]) if op == "reduce_scatter" else nbytes(args[0])
        uid = self.uid()
        is_async = bool(self.in_backward)
        info = self._info(op)
        pgi = self._pg(pg, ranks) if pg is not None else 0
        if pgi:
            info["pg"] = pgi
        self.events.append(("coll", t0, t1, uid, op, ranks, s, is_async, info))
        if is_async:
            self.backward_pending.append(uid)
        return out

    def functional_op(self, func, op, args, kwargs):
        """A functional collective (DTensor): asynchronous, waited at ``wait_tensor`` of its output."""
        t0 = now_ns()
        out = func(*args, **kwargs)
        t1 = now_ns()
        if op is None:
            return out
        from torch.distributed.distributed_c10d import _resolve_process_group

        name = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, str) and a not in
                     ("sum", "avg", "max", "min", "product", "premul_sum")), None)
        pg = None
        try:
            pg = _resolve_process_group(name) if name is not None else None
            ranks = self._ranks(pg)
        except Exception:  # noqa: BLE001
            ranks = tuple(range(self.world_size))
        s = nbytes(out) if op == "all_gather" else nbytes(args[0])
        uid = self.uid()
        info = self._info(op)
        pgi = self._pg(pg, ranks) if pg is not None else 0
        if pgi:
            info["pg"] = pgi
        self.events.append(("coll", t0, t1, uid, op, ranks, s, True, info))
        outs: list = []
        _tensors(out, outs)
        for t in outs:
            self.tensor_uids[id(t)] = (uid, t)
        return out

    # -- sleep, backward, DDP hooks ------------------------------------------------------------------------------
    def _sleep(self, orig):
        tracer = self

        def sleep(seconds):
            t0 = now_ns()
            if threading.get_ident() == tracer.main:
                tracer.gap(t0)
            orig(seconds)
            if threading.get_ident() == tracer.main:
                t1 = now_ns()
                tracer.events.append(("s", t0, t1, float(seconds)))
                tracer.mark(t1)

        return sleep

    def _backward(self, orig):
        tracer = self

        def backward(*args, **kwargs):
            tracer.in_backward += 1
            try:
                return orig(*args, **kwargs)
            finally:
                tracer.in_backward -= 1
                if not tracer.in_backward and tracer.backward_pending:
                    t = now_ns()
                    tracer.record_waits(tuple(tracer.backward_pending), t, t)
                    tracer.backward_pending.clear()

        backward.__wrapped__ = orig
        return backward

    def _ddp_hook(self, orig):
        tracer = self

        def register_comm_hook(ddp, hook_state, hook):
            def traced(s, bucket):
                tracer.hook_depth += 1
                try:
                    return hook(s, bucket)
                finally:
                    tracer.hook_depth -= 1

            traced.__name__ = getattr(hook, "__name__", "hook")
            try:
                traced.__signature__ = inspect.signature(hook)
            except (TypeError, ValueError):
                pass
            return orig(ddp, hook_state, traced)

        return register_comm_hook


def _no_compile(*args, **kwargs):
    """``torch.compile`` inside an emulated rank: refused, because compiled graphs run their operations and
    collectives where the tracer cannot see them (the run would get a wrong timeline)."""
    raise RuntimeError("torch.compile cannot be emulated: compiled graphs hide their operations and collectives "
                       "from the emulator's tracer; run this variant without emulate=, or without torch.compile "
                       "(see labkit.runtime.emulate.VARIANTS)")


def start(rank: int, world_size: int) -> Tracer:
    """Start tracing this rank (the worker calls this when ``launch(..., emulate=...)``)."""
    return Tracer(rank, world_size).start()
