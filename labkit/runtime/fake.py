"""Full scale without a GPU: a rank function run at a real model's shapes under fake tensors and torch's
fake process group, one process acting as rank r of a world of N.

``launch(fn, world_size, fake=True)`` (or :func:`launch_fake`) starts **one** child interpreter (``python -P``,
as every rank: nothing is imported from the working directory) that, for each traced rank r,

* creates the process group with torch's ``fake`` backend (``torch.testing._internal.distributed.fake_pg``:
  every collective returns at once, no data moves) at rank r of ``world_size``;
* enters ``FakeTensorMode`` (``torch._subclasses.fake_tensor``): every tensor carries its shape, dtype and
  device and no storage, so a 70B model "exists" in a few hundred MB of host memory. Device meshes are
  built with fake mode paused (``DeviceMesh`` reads its rank table as data);
* calls ``fn(ctx, *args, **kwargs)`` with a :class:`~labkit.runtime.rank.RankContext` (``backend="fake"``);
* with ``emulate=...``, records the rank's trace with :class:`FakeTracer` (the emulator's tracer, pricing
  fake tensors: their shapes are the real GEMM shapes and their byte counts the real collective sizes).

**Rank symmetry** (``roles=``): ranks that play the same role — the same program on tensors of the same
shapes, their groups a relabelling of each other's (same stage, mesh coordinates that differ only in the data
parallel, or any symmetric, dimension) — are traced once. ``roles`` maps every rank to the rank that is
traced for it (a dict, or a function of the rank); a rank not traced gets its representative's result, and,
when emulating, its representative's trace relabelled by :func:`relabel` (each group and peer moved by the
mesh-coordinate shift that takes the representative to the rank). ``result.roles`` says which rank was traced
for which. :func:`mesh_roles` gives the roles of a ``ParallelDims`` mesh.

What a fake run cannot do, and says: results that need tensor data (``loss.item()``, ``float(t)``, a
data-dependent shape such as MoE routing's token counts) raise :class:`FakeDataError` naming the operation;
a result that holds a tensor is refused (return shapes or byte counts). Strategies that route tokens by data
are run with a stated assumption instead (``labkit.experiments.fullscale``: uniform routing).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_TIMEOUT_S = 600.0


class FakeDataError(RuntimeError):
    """A fake-tensor run asked for tensor data (a value, or a shape that depends on values)."""


# ------------------------------------------------------------------------------------------------------
# roles: which rank is traced for which
# ------------------------------------------------------------------------------------------------------
def mesh_roles(dims, symmetric=("dp",)) -> dict[int, int]:
    """rank -> the rank traced for it, on a :class:`labkit.theory.mesh.ParallelDims` mesh: ranks whose
    coordinates differ only in the ``symmetric`` dims (default: data parallel) share the representative whose
    coordinate is 0 in those dims. ``symmetric=("dp", "tp")`` also folds tensor-parallel ranks (same shapes,
    same collectives) onto tp-rank 0; pipeline stages always stay distinct roles (different layers, first and
    last stage's embedding and head). Raises ValueError for an unknown dim."""
    for d in symmetric:
        if d not in ("dp", "tp", "cp", "ep"):
            raise ValueError(f"symmetric dim {d!r} is not valid; choose from dp, tp, cp, ep (pp stages differ)")
    out = {}
    for r in range(dims.world_size):
        c = dict(dims.coords(r))
        for d in symmetric:
            if d in c:
                c[d] = 0
        out[r] = dims.rank_of(**c)
    return out


def _role_map(roles, world_size: int) -> dict[int, int]:
    if roles is None:
        return {r: r for r in range(world_size)}
    m = {r: int(roles(r)) for r in range(world_size)} if callable(roles) else {int(k): int(v) for k, v in
                                                                             dict(roles).items()}
    missing = [r for r in range(world_size) if r not in m]
    if missing:
        raise ValueError(f"roles has no entry for rank(s) {missing[:8]}; give every rank 0..{world_size - 1} "
                         "the rank traced for it")
    bad = {r: v for r, v in m.items() if not 0 <= v < world_size or m.get(v) != v}
    if bad:
        r, v = next(iter(bad.items()))
        raise ValueError(f"roles maps rank {r} to {v}, which is not a traced rank (a traced rank maps to itself, "
                         f"0 <= rank < {world_size})")
    return m


def relabel(trace: list, perm) -> list:
    """``trace`` (the emulator's format, :mod:`labkit.theory.replay`) with every global rank ``x`` in its groups
    and peers replaced by ``perm(x)`` (groups re-sorted). ``perm`` must map the mesh's groups onto groups
    (a coordinate shift does: :func:`shift_perm`)."""
    out = []
    cache: dict = {}
    for ev in trace:
        k = ev[0]
        if k == "coll":
            ranks = ev[5]
            g = cache.get(ranks)
            if g is None:
                g = cache[ranks] = tuple(sorted(perm(x) for x in ranks))
            out.append(ev[:5] + (g,) + ev[6:])
        elif k == "p2p":
            out.append(ev[:5] + (perm(ev[5]) if ev[5] is not None and ev[5] >= 0 else ev[5],) + ev[6:])
        else:
            out.append(ev)
    return out


def shift_perm(dims, src: int, dst: int):
    """The permutation of ranks that shifts every rank's mesh coordinates by ``coords(dst) - coords(src)``
    (mod each degree): it takes ``src`` to ``dst`` and every group of the mesh onto a group of the same dim."""
    cs, cd = dims.coords(src), dims.coords(dst)
    delta = {k: cd[k] - cs[k] for k in cs}
    deg = {k: dims.degree(k) for k in cs}
    table: dict[int, int] = {}

    def perm(x: int) -> int:
        y = table.get(x)
        if y is None:
            c = dims.coords(x)
            y = table[x] = dims.rank_of(**{k: (c[k] + delta[k]) % deg[k] for k in c})
        return y

    return perm


# ------------------------------------------------------------------------------------------------------
# inside the child: one rank at a time
# ------------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """This process as rank ``rank`` of ``world_size`` on torch's fake backend, under ``FakeTensorMode``
    (yields the mode). Device meshes are built with fake mode paused. Not for the caller's process: the
    launcher runs it in a child."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
    from torch.distributed import device_mesh as _dm
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process; a fake world needs its own process")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    orig_init, orig_make = _dm.DeviceMesh.__init__, _dm.init_device_mesh
    holders = [m for m in (_dm, dist, sys.modules.get("labkit.parallel.mesh"))
               if m is not None and getattr(m, "init_device_mesh", None) is orig_make]

    def mesh_init(self, *a, **k):
        with unset_fake_temporarily():
            orig_init(self, *a, **k)

    def make_mesh(*a, **k):  # the rank table is data: built outside fake mode
        with unset_fake_temporarily():
            return orig_make(*a, **k)

    _dm.DeviceMesh.__init__ = mesh_init
    for m in holders:
        m.init_device_mesh = make_mesh
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            yield mode
    finally:
        _dm.DeviceMesh.__init__ = orig_init
        for m in holders:
            m.init_device_mesh = orig_make
        dist.destroy_process_group()


def _fake_tracer_class():
    import torch

    from labkit.runtime.emulate import tracer as _tr

    class _FakeMode(_tr._Mode):
        """The tracer's dispatch mode, pricing fake tensors as the plain tensors they stand for."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            fake = self.fake
            if fake is not None:
                types = tuple(torch.Tensor if issubclass(t, fake) else t for t in types)
            return super().__torch_dispatch__(func, types, args, kwargs)

    class FakeTracer(_tr.Tracer):
        """:class:`labkit.runtime.emulate.tracer.Tracer` whose dispatch mode prices FakeTensors (the base
        tracer hands them on unpriced: in a real run they are torch's own shape propagation)."""

        def start(self):
            super().start()
            self._mode.__exit__(None, None, None)
            self._mode = _FakeMode(self)
            self._mode.__enter__()
            return self

    return FakeTracer


def _check_result(value, rank: int, where: str = "result") -> None:
    import torch

    if isinstance(value, torch.Tensor):
        raise FakeDataError(f"rank {rank} returned a tensor ({where}: shape {tuple(value.shape)}, "
                            f"{value.dtype}); a fake-tensor run has no data: return shapes, byte counts or "
                            "plain numbers instead")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_result(v, rank, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_result(v, rank, f"{where}[{i}]")


def run_rank(fn, rank: int, world_size: int, args=(), kwargs=None, *, trace: bool = False):
    """``fn(ctx, *args, **kwargs)`` as rank ``rank`` of a fake world (in this process: the child's entry
    point, and tests). Returns ``(result, trace or None, seconds)``. Raises :class:`FakeDataError` when the
    function needs tensor data, with the operation named."""
    import torch
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from labkit.runtime.rank import RankContext

    kwargs = kwargs or {}
    t0 = time.perf_counter()
    tracer = None
    with fake_world(rank, world_size):
        ctx = RankContext(rank, world_size, rank, world_size, 0, "fake", torch.device("cpu"))
        try:
            if trace:
                tracer = _fake_tracer_class()(rank, world_size).start()
            try:
                out = fn(ctx, *args, **kwargs)
            finally:
                events = tracer.stop() if tracer is not None else None
        except DataDependentOutputException as e:
            raise FakeDataError(f"rank {rank}: {e.func if hasattr(e, 'func') else e} needs tensor data (a value "
                                "such as loss.item(), or a shape that depends on values); a fake-tensor run has "
                                "none: return shapes or byte counts, or state an assumption for the "
                                "data-dependent step") from e
        except Exception as e:  # noqa: BLE001 - data-dependent shapes surface as several torch exception types
            if type(e).__name__ in ("DynamicOutputShapeException", "GuardOnDataDependentSymNode",
                                    "DataDependentOutputException"):
                raise FakeDataError(f"rank {rank}: {type(e).__name__}: {e}; the operation's output shape "
                                    "depends on tensor values, which a fake-tensor run does not have") from e
            raise
    _check_result(out, rank)
    return out, events, time.perf_counter() - t0


def child_main(argv: list[str]) -> int:
    """The child's entry (``boot_argv``): read ``DIR/job.pkl``, run every traced rank, write
    ``DIR/result.pkl`` (or ``DIR/error.pkl``)."""
    import traceback

    import cloudpickle

    d = Path(argv[0])
    job = pickle.loads((d / "job.pkl").read_bytes())
    for entry in reversed(job.get("sys_path", [])):  # the caller's import path (never its working directory)
        if entry not in sys.path:
            sys.path.insert(0, entry)
    payload = cloudpickle.loads(job["payload"])
    fn, args, kwargs = payload["fn"], payload["args"], payload["kwargs"]
    torch_threads = int(job.get("threads", 1))
    import torch

    torch.set_num_threads(torch_threads)
    out = {"results": {}, "traces": {}, "seconds": {}}
    try:
        for r in job["traced"]:
            res, events, sec = run_rank(fn, r, job["world_size"], args, kwargs, trace=job["trace"])
            out["results"][r], out["traces"][r], out["seconds"][r] = res, events, sec
        (d / "result.pkl").write_bytes(pickle.dumps(out))
        return 0
    except BaseException as e:  # noqa: BLE001 - report whatever it is
        (d / "error.pkl").write_bytes(pickle.dumps({"type": type(e).__name__, "message": str(e),
                                                    "traceback": traceback.format_exc()}))
        return 1


# ------------------------------------------------------------------------------------------------------
# the caller's side
# ------------------------------------------------------------------------------------------------------
def launch_fake(fn, world_size: int, *args, roles=None, emulate=None, timeout_s: float = DEFAULT_TIMEOUT_S,
                threads: int = 1, dims=None, record: bool = False, **kwargs):
    """Run ``fn(ctx, *args, **kwargs)`` as every traced rank of a fake world of ``world_size`` ranks, in one
    child process (module docstring), and return a :class:`labkit.runtime.launcher.LaunchResult` with one
    entry per rank (a rank that was not traced gets its representative's result, the same object).

    Args:
        fn: a function or ``"module:function"`` (shipped by value as for ``launch``).
        world_size: ranks of the fake world (>= 1; no host-memory cap: fake ranks hold no data).
        roles: rank -> traced rank (dict or function; :func:`mesh_roles`); default every rank is traced.
        emulate: as ``launch``'s (a profile name, Cluster or dict): the traces are replayed on it
            (:mod:`labkit.theory.replay`) and ``result.emulation`` / ``result.emulated`` set.
        dims: the ParallelDims mesh that ``roles`` folds (needed to relabel traces when emulating with roles).
        timeout_s: wall-clock limit for the child (seconds); on expiry it is killed and TimeoutError raised.
        threads: torch intra-op threads in the child (fake ops do no arithmetic: 1 is enough).
        record: record the traced ranks' traces without replaying them (``result.fake_traces``: traced rank ->
            its trace), for a caller that prices or relabels them itself.

    Returns the LaunchResult (``backend="fake"``, ``wall_s`` measured), with ``roles`` (rank -> traced rank),
    ``traced`` (the traced ranks) and ``trace_s`` (seconds per traced rank, measured).

    Raises ValueError for a bad world size, roles or emulate option (before anything starts);
    :class:`FakeDataError` when the function needs tensor data; RuntimeError with the child's traceback for
    any other failure in it; TimeoutError after ``timeout_s``.
    """
    import pandas as pd

    from labkit.checks import positive_float, positive_int
    from labkit.runtime.launcher import LaunchResult
    from labkit.runtime.safepath import boot_argv, shipped_sys_path
    from labkit.runtime.shipping import ship

    world_size = positive_int("world_size", world_size)
    timeout_s = positive_float("timeout_s", timeout_s)
    role = _role_map(roles, world_size)
    traced = sorted(set(role.values()))
    plan = None
    if emulate is not None:
        from labkit.runtime import emulate as _em

        plan = _em.resolve(emulate, world_size)
        if roles is not None and dims is None and len(traced) < world_size:
            raise ValueError("emulating with roles needs dims= (the ParallelDims mesh the roles fold) to relabel "
                             "each representative's trace for the ranks it stands for")
    if isinstance(fn, str):
        from labkit.runtime.worker import resolve_function

        fn = resolve_function(fn)
    payload = ship(fn, args, kwargs)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="labkit-fake-") as tmp:
        d = Path(tmp)
        (d / "job.pkl").write_bytes(pickle.dumps({"payload": payload, "world_size": world_size, "traced": traced,
                                                  "trace": plan is not None or record,
                                                  "threads": threads, "sys_path": shipped_sys_path()}))
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        try:
            proc = subprocess.run(boot_argv("labkit.runtime.fake", "child_main", [str(d)]), env=env,
                                  timeout=timeout_s, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the fake-tensor run of {world_size} ranks ({len(traced)} traced) did not finish "
                               f"within timeout_s={timeout_s:g} s") from None
        if (d / "error.pkl").exists():
            err = pickle.loads((d / "error.pkl").read_bytes())
            if err["type"] == "FakeDataError":
                raise FakeDataError(err["message"])
            raise RuntimeError(f"fake-tensor run failed: {err['type']}: {err['message']}\n{err['traceback']}")
        if proc.returncode != 0 or not (d / "result.pkl").exists():
            raise RuntimeError(f"fake-tensor child exited {proc.returncode}: {proc.stderr[-2000:]}")
        out = pickle.loads((d / "result.pkl").read_bytes())
    wall = time.perf_counter() - t0
    results = [out["results"][role[r]] for r in range(world_size)]
    res = LaunchResult(results, pd.DataFrame(), world_size, "fake", wall)
    res.roles, res.traced, res.trace_s = role, traced, out["seconds"]
    res.fake_traces = out["traces"] if record else None
    if plan is not None:
        traces = expand_traces(out["traces"], role, dims)
        from labkit.runtime import emulate as _em

        em = _em._replay(plan, traces, [0] * world_size)
        res.emulation = em
        res.emulated = None
    return res


def expand_traces(traced: dict, role: dict, dims=None) -> list:
    """Every rank's trace from the traced ones: rank r gets ``role[r]``'s trace relabelled by the mesh shift
    from ``role[r]`` to r (:func:`shift_perm`; ``dims`` required when any rank is not traced)."""
    out = []
    for r in range(len(role)):
        rep = role[r]
        if rep == r:
            out.append(traced[r])
        else:
            out.append(relabel(traced[rep], shift_perm(dims, rep, r)))
    return out


if __name__ == "__main__":  # pragma: no cover - started through boot_argv
    sys.exit(child_main(sys.argv[1:]))
