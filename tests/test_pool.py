"""Warm ranks (issue 18): labkit.Pool runs one rank function after another on the same processes.

Isolation between runs (module globals, labkit's own state, tensors, process groups, thread count and torch
settings, RNG as a cold rank's), failure recovery (raise, hang, SIGKILL, a destroyed or inconsistent group, each
followed by a clean run), no orphans after the holder's death or exit, bounded pools, routing, loopback only, and
a DP parity run giving the same results warm as cold. World size 2.
"""

from __future__ import annotations

import gc
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

import labkit
from labkit import launch
from labkit.runtime import pool as pool_mod
from labkit.runtime import zygote
from labkit.runtime.launcher import LaunchTimeout, RankFailed
from labkit.runtime.rendezvous import is_loopback, listening_addresses
from labkit.runtime.reset import TORCH_FIXED_DEFAULT_SEED

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process trees and /proc are Linux")

STATE: list = []  # a module global that run 1 fills; run 2 must see it empty


_SHARED: list = []  # the module's shared pool, kept open across the tests that use it


def _tree(p) -> set[int]:
    if p.closed or p._ranks is None:
        return set()
    sup = psutil.Process(p._ranks.procs.sup.pid)
    return {sup.pid, *(c.pid for c in sup.children(recursive=True))}


@pytest.fixture(autouse=True)
def no_pools_left():
    """After each test: no pool but the shared one is open, and no process of ours is left but its tree."""
    yield
    for p in pool_mod.open_pools():
        if p not in _SHARED:
            p.close()
    keep = set().union(*(_tree(p) for p in _SHARED)) if _SHARED else set()
    deadline = time.monotonic() + 10
    keep.add(zygote.template_pid())
    while (kids := [p for p in psutil.Process().children(recursive=True)
                    if p.status() != psutil.STATUS_ZOMBIE and p.pid not in keep]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not kids, f"processes left: {[(p.pid, p.cmdline()[-2:]) for p in kids]}"


@pytest.fixture(scope="module")
def pool():
    with labkit.Pool(2, timeout_s=120) as p:
        _SHARED.append(p)
        yield p
        _SHARED.remove(p)


# ---------------------------------------------------------------------------------------------------
# rank functions
# ---------------------------------------------------------------------------------------------------
def who(ctx):
    t = torch.tensor([float(ctx.rank + 1)])
    with ctx.timer("all_reduce", "comm"):
        dist.all_reduce(t)
    return {"pid": os.getpid(), "sum": t.item(), "events": len(ctx.timeline.events)}


def dirty(ctx):
    """Leave every kind of state behind."""
    STATE.append(torch.ones(12345))
    torch.set_num_threads(3)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    os.environ["LABKIT_TEST_LEFTOVER"] = "1"
    dist.all_reduce = lambda *a, **k: None  # a monkeypatch never undone
    torch.set_grad_enabled(False)
    return len(STATE)


def inspect_state(ctx):
    leftovers = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel() == 12345]
    t = torch.ones(1)
    dist.all_reduce(t)  # the real one again
    return {"state": len(STATE), "threads": torch.get_num_threads(), "dtype": str(torch.get_default_dtype()),
            "seed": torch.initial_seed(), "env": os.environ.get("LABKIT_TEST_LEFTOVER"), "sum": t.item(),
            "grad": torch.is_grad_enabled(), "tensors": len(leftovers), "pid": os.getpid()}


class Counter:  # shipped by reference: the class lives in this module, which a run re-imports afresh
    hits = 0


def dirty_more(ctx):
    """State in labkit's own modules, a new process group, a class attribute, stdin."""
    from labkit.runtime import training

    training.CURRENT.step = 99  # a labkit object at module level, changed in place
    training.LEFTOVER = torch.ones(12345)  # a global the run adds to a labkit module
    training.now_ns = lambda: 0  # a labkit global the run rebinds
    Counter.hits += 1
    g = dist.new_group([0, 1])
    t = torch.ones(1)
    dist.all_reduce(t, group=g)
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - replaced and never put back
    return {"stdin": sys.stdin.read(), "sum": t.item(), "groups": _group_count(), "hits": Counter.hits}


def inspect_more(ctx):
    from labkit.runtime import timeline, training

    leftovers = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel() == 12345]
    return {"step": training.CURRENT.step, "leftover": hasattr(training, "LEFTOVER"),
            "now_ns": training.now_ns is timeline.now_ns, "hits": Counter.hits, "groups": _group_count(),
            "stdout": sys.stdout is sys.__stdout__ or type(sys.stdout).__name__, "tensors": len(leftovers)}


def _group_count() -> int:
    from torch.distributed.distributed_c10d import _world

    return len(_world.pg_map)


def rng_probe(ctx):
    return {"seed": torch.initial_seed(), "draw": torch.rand(3).tolist(), "py": random.random()}


def raise_on_rank1(ctx):
    if ctx.rank == 1:
        raise ValueError("deliberate failure on a warm rank")
    dist.all_reduce(torch.ones(1))


def hang(ctx):
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        time.sleep(600)


def sigkill_rank1(ctx):
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def destroy_group(ctx):
    if ctx.rank == 0:
        dist.destroy_process_group()
    return ctx.rank


def unmatched_collective(ctx):
    """Rank 0 issues one all_reduce more than rank 1: the results come back, but the ranks now disagree about
    where they are in the group's sequence of collectives (the post-run check pairs with the extra one)."""
    if ctx.rank == 0:
        dist.all_reduce(torch.zeros(2, dtype=torch.int64))
    return ctx.rank


def leave_child(ctx, pid_dir):
    p = subprocess.Popen(["sleep", "600"], start_new_session=True)
    Path(pid_dir, f"rank{ctx.rank}.json").write_text(json.dumps([p.pid]))
    return p.pid


def listening(ctx):
    dist.barrier()
    out = {os.getpid(): listening_addresses()}
    if ctx.rank == 0:
        out[os.getppid()] = listening_addresses(os.getppid())  # the supervisor
    return out


def dp_parity(ctx, steps=3):
    """torch DDP on a small MLP, each rank its half of a fixed batch; returns the weights after ``steps``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rng = rng_probe(ctx)  # what the rank's generator held when the run started, before seeding
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    n = 8 // ctx.world_size
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x[ctx.rank * n:(ctx.rank + 1) * n]), y[ctx.rank * n:(ctx.rank + 1) * n])
        loss.backward()
        opt.step()
    return {"rng": rng, "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def dp_reference(steps=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


# ---------------------------------------------------------------------------------------------------
# warm runs
# ---------------------------------------------------------------------------------------------------
def test_runs_reuse_the_same_ranks_and_routing(pool):
    a = launch(who, 2, echo=False)  # routed to the open pool of this shape
    b = pool.run(who, echo=False)
    c = launch(who, 2, pool=pool, echo=False)
    assert [r["pid"] for r in a] == [r["pid"] for r in b] == [r["pid"] for r in c] == pool.pids()
    assert all(r["sum"] == 3.0 and r["events"] == 1 for r in (*a, *b, *c))  # a fresh timeline each run
    assert len(c.timeline) == 2 and c.world_size == 2 and c.backend == "gloo"
    with pytest.raises(ValueError, match="runs world_size=2"):
        launch(who, 1, pool=pool)


def test_a_run_leaves_nothing_for_the_next(pool):
    assert list(pool.run(dirty, echo=False)) == [1, 1]
    after = pool.run(inspect_state, echo=False)
    for r in after:
        assert r["state"] == 0, "a module global of the previous run is visible"
        assert r["tensors"] == 0, "a tensor of the previous run is still reachable"
        assert r["threads"] == pool.threads and r["dtype"] == "torch.float32" and r["grad"] is True
        assert r["seed"] != 0 and r["env"] is None and r["sum"] == 2.0
    assert after[0]["seed"] != pool.run(inspect_state, echo=False)[0]["seed"]  # reseeded every run


def test_a_run_asking_for_other_threads_gets_them_and_the_next_gets_the_default_back(pool):
    assert [r["threads"] for r in pool.run(inspect_state, threads_per_rank=2, echo=False)] == [2, 2]
    assert [r["threads"] for r in launch(inspect_state, 2, echo=False)] == [pool.threads] * 2


def test_labkit_state_groups_classes_stdin_and_stdout_are_reset(pool):
    first = pool.run(dirty_more, echo=False)
    assert [r["stdin"] for r in first] == ["", ""]  # a rank function reading stdin gets EOF, not the next job
    assert all(r["sum"] == 2.0 and r["hits"] == 1 for r in first)
    for r in pool.run(inspect_more, echo=False):
        assert r["step"] == -1, "a labkit module object keeps what the previous run set"
        assert not r["leftover"] and r["now_ns"], "a labkit module global added or rebound by a run survives"
        assert r["hits"] == 0, "a class attribute set by the previous run is visible"
        assert r["groups"] == first[0]["groups"] - 1, "the process group the previous run created is not destroyed"
        assert r["stdout"] is True and r["tensors"] == 0
    again = pool.run(dirty_more, echo=False)
    assert [r["groups"] for r in again] == [r["groups"] for r in first]  # groups do not pile up run after run


def test_by_value_globals_and_classes_are_fresh_each_run(pool):
    ns = {}
    exec(textwrap.dedent("""
        COUNT = 0
        class Box:
            items = []
        def bump(ctx):
            global COUNT
            COUNT += 1
            Box.items.append(ctx.rank)
            return COUNT, len(Box.items)
    """), ns)
    ns["bump"].__module__ = "__main__"  # as in a notebook cell: shipped by value
    ns["Box"].__module__ = "__main__"
    assert [tuple(r) for r in pool.run(ns["bump"], echo=False)] == [(1, 1), (1, 1)]
    assert [tuple(r) for r in pool.run(ns["bump"], echo=False)] == [(1, 1), (1, 1)]


def _entropy_seeded(seeds: list[int]) -> bool:
    return len(set(seeds)) == len(seeds) and TORCH_FIXED_DEFAULT_SEED not in seeds


def test_warm_dp_parity_equals_cold_and_the_reference():
    pool_mod.close_all()  # the shared pool too (the tests above are done with it): this launch must be cold
    with labkit.Pool(1, start=False) as other:  # a pool of another shape does not make a 2-rank launch warm
        cold = launch(dp_parity, 2, echo=False)
        assert other.runs == 0 and other.starts == 0
    with labkit.Pool(2) as p:
        before = p.run(rng_probe, echo=False)
        warm = p.run(dp_parity, echo=False)  # on ranks that already ran something
        assert p.runs == 2 and p.starts == 1
    assert set(warm[0]["weights"]) == set(cold[0]["weights"])
    for w, c in zip(warm, cold):
        for k in w["weights"]:
            torch.testing.assert_close(w["weights"][k], c["weights"][k], rtol=0, atol=0)  # bit for bit
    for k, v in dp_reference().items():  # fp32 tolerance, as the DP tests use
        torch.testing.assert_close(warm[0]["weights"][k], v, rtol=1e-4, atol=1e-5)
    # RNG as a cold rank has it: this torch seeds each fresh process from entropy (every rank and every launch
    # its own seed), or every process with its fixed default; a warm run starts as the cold one did
    cold_rng = [r["rng"] for r in cold]
    warm_rng = [*before, *(r["rng"] for r in warm)]
    cold_seeds, warm_seeds = [r["seed"] for r in cold_rng], [r["seed"] for r in warm_rng]
    if _entropy_seeded(cold_seeds):
        assert _entropy_seeded(warm_seeds), warm_seeds
        assert len({tuple(r["draw"]) for r in (*cold_rng, *warm_rng)}) == 6
    else:
        assert set(cold_seeds) == set(warm_seeds) == {TORCH_FIXED_DEFAULT_SEED}
        assert {tuple(r["draw"]) for r in warm_rng} == {tuple(cold_rng[0]["draw"])}
    assert len({r["py"] for r in (*cold_rng, *warm_rng)}) == 6  # Python's random: from OS entropy


def test_pool_listens_on_loopback_only():
    with labkit.Pool(2) as p:
        for _ in range(2):
            res = p.run(listening, echo=False)
            sockets = [s for r in res for addrs in r.values() for s in addrs]
            assert sockets and all(is_loopback(a) for a, _ in sockets), sockets


# ---------------------------------------------------------------------------------------------------
# failure recovery: the same reports as a cold launch, then a clean run on fresh ranks
# ---------------------------------------------------------------------------------------------------
def test_raise_then_a_clean_run():
    with labkit.Pool(2, timeout_s=60) as p:
        first = p.pids()
        with pytest.raises(RankFailed, match="rank 1 of 2 raised ValueError") as info:
            p.run(raise_on_rank1, echo=False)
        assert info.value.rank == 1 and "raise ValueError" in info.value.traceback_text
        assert p.pids() == []  # torn down
        res = p.run(who, echo=False)
        assert [r["sum"] for r in res] == [3.0, 3.0] and p.starts == 2
        assert not set(first) & {r["pid"] for r in res}


def test_hang_past_timeout_then_a_clean_run():
    with labkit.Pool(2, timeout_s=60) as p:
        p.run(who, echo=False)
        t0 = time.monotonic()
        with pytest.raises(LaunchTimeout, match="timed out after 8 s") as info:
            p.run(hang, echo=False, timeout_s=8)
        assert 8 <= time.monotonic() - t0 < 8 + 5
        assert "Every rank was inside the rank function" in str(info.value)
        assert "hang" in info.value.stacks[0] and "hang" in info.value.stacks[1]
        assert [r["sum"] for r in p.run(who, echo=False)] == [3.0, 3.0] and p.starts == 2


def test_sigkilled_ranks_then_a_clean_run():
    with labkit.Pool(2, timeout_s=60) as p:
        with pytest.raises(RankFailed, match="rank 1 of 2 was killed by SIGKILL") as info:
            p.run(sigkill_rank1, echo=False)  # killed during a run
        assert info.value.signal_name == "SIGKILL"
        p.run(who, echo=False)
        assert p.starts == 2
        os.kill(p.pids()[1], signal.SIGKILL)  # killed between runs, from outside
        time.sleep(0.5)
        assert [r["sum"] for r in p.run(who, echo=False)] == [3.0, 3.0] and p.starts == 3


def test_a_run_that_destroys_the_group_returns_then_the_pool_starts_afresh():
    with labkit.Pool(2, timeout_s=60) as p:
        assert list(p.run(destroy_group, echo=False)) == [0, 1]
        assert [r["sum"] for r in p.run(who, echo=False)] == [3.0, 3.0] and p.starts == 2
        assert "destroyed the default process group" in p.restart_reason


def test_a_run_that_leaves_the_ranks_out_of_step_returns_then_the_pool_starts_afresh():
    with labkit.Pool(2, timeout_s=60) as p:
        assert list(p.run(unmatched_collective, echo=False)) == [0, 1]
        assert [r["sum"] for r in p.run(who, echo=False)] == [3.0, 3.0] and p.starts == 2
        assert p.restart_reason is not None


# ---------------------------------------------------------------------------------------------------
# bounded, closed, no orphans
# ---------------------------------------------------------------------------------------------------
def test_one_pool_per_shape_and_close(tmp_path):
    a = labkit.Pool(2)
    b = labkit.Pool(2)  # re-running a cell `pool = labkit.Pool(2)`: the older one is closed
    assert a.closed and not b.closed and pool_mod.open_pools() == [b]
    with pytest.raises(ValueError, match="is closed"):
        launch(who, 2, pool=a)
    b.run(leave_child, str(tmp_path), echo=False)  # a run leaves a daemon behind
    kids = [p for f in tmp_path.glob("*.json") for p in json.loads(f.read_text())]
    b.close()
    time.sleep(0.5)
    assert not [k for k in kids if psutil.pid_exists(k) and psutil.Process(k).status() != "zombie"]
    assert pool_mod.open_pools() == []


def test_keep_warm_and_shared_pool():
    first = launch(who, 2, echo=False, keep_warm=True)  # opens the shared pool of this shape, leaves it open
    p = pool_mod.shared_pool(2)
    assert pool_mod.open_pools() == [p] and p.runs == 1
    second = launch(who, 2, echo=False)  # an open pool of this shape runs it: warm without asking
    third = launch(who, 2, echo=False, keep_warm=True)
    assert [r["pid"] for r in first] == [r["pid"] for r in second] == [r["pid"] for r in third] == p.pids()
    assert pool_mod.shared_pool(2) is p and p.runs == 3
    pool_mod.close_all()
    assert p.closed and pool_mod.open_pools() == []


def test_pool_is_refused_like_a_launch_when_it_does_not_fit():
    with pytest.raises(ValueError, match="world_size=3 is above max_world_size=2"):
        labkit.Pool(3, max_world_size=2)
    with pytest.raises(ValueError, match="does not fit in this host's memory"):
        labkit.Pool(10**6)
    with pytest.raises(ValueError, match="does not fit in this host's memory"):
        launch(who, 10**6, keep_warm=True)
    assert pool_mod.open_pools() == []


def test_a_forked_child_never_uses_or_closes_the_parents_pool():
    # Python 3.12+ warns at os.fork() when the process has other OS threads ("This process is multi-threaded,
    # use of fork() may lead to deadlocks in the child"); here they are torch's intra-op pool, started by an
    # earlier test's tensor op (3 OS threads after one matmul in a fresh interpreter), and any labkit thread
    # still running. The deadlock it warns of is a child that
    # takes a lock one of those threads held at the fork. This child takes none: it reads the pool module's
    # plain Python state (a pool whose owner pid is not the child's is closed to it), calls close_all on
    # nothing and leaves by os._exit, with no torch op, logging or import. So it is safe here, and the
    # child's exit status shows it ran to the end.
    with labkit.Pool(2, start=False) as p, warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"This process .* is multi-threaded", DeprecationWarning)
        pid = os.fork()
        if pid == 0:  # the child: the pool is not its own
            ok = p.closed and pool_mod.open_pools() == [] and pool_mod.pool_for(2, "gloo") is None
            pool_mod.close_all()
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not p.closed and pool_mod.open_pools() == [p]


_HOLDER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import labkit
    from test_pool import leave_child
    pool = labkit.Pool(2)
    pool.run(leave_child, {pid_dir!r}, echo=False)
    print(json.dumps(pool.pids()), flush=True)
    sys.stdin.readline()  # then exit without closing the pool: the exit hook must
""")


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_no_orphans_when_the_holder_of_a_pool_dies_or_exits(tmp_path, how):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER.format(tests=str(REPO / "tests"), pid_dir=str(tmp_path))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    line = proc.stdout.readline()
    assert line, proc.stderr.read()[-2000:]
    ranks = json.loads(line)
    tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    kids = [p for f in tmp_path.glob("*.json") for p in json.loads(f.read_text())]
    run_dirs = list(Path(tempfile.gettempdir()).glob(f"labkit-launch-{proc.pid}-*"))
    assert len(ranks) == 2 and len(kids) == 2 and len(run_dirs) == 1 and len(tree) >= 5  # supervisor, 2 ranks, 2 kids
    if how == "sigkill":
        proc.kill()  # like a kernel SIGKILLed: no exit hook runs
    else:
        proc.stdin.write("\n")
        proc.stdin.flush()
    proc.wait(timeout=30)
    alive = _wait_gone([*ranks, *kids, *tree], run_dirs[0])
    assert not alive, f"orphans after the holder's {how}: {alive}"
    assert not run_dirs[0].exists()
    if how == "exit":
        assert proc.returncode == 0, proc.stderr.read()[-2000:]


def _wait_gone(pids: list[int], run_dir: Path, timeout_s: float = 10.0) -> list[int]:
    """Wait up to ``timeout_s`` for every process of ``pids`` to end and ``run_dir`` to be removed; SIGKILL and
    return the pids still alive then (the caller asserts there are none)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        if (not alive and not run_dir.exists()) or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    for p in alive:
        os.kill(p, signal.SIGKILL)
    return alive


_KERNEL_CELL = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {tests!r})
    import labkit
    from test_pool import leave_child
    labkit.launch(leave_child, 2, {pid_dir!r}, keep_warm=True, echo=False)
    pool = labkit.runtime.pool.shared_pool(2)
    print(json.dumps({{"ranks": pool.pids(), "kernel": os.getpid()}}))
""")


def test_kernel_shutdown_closes_the_shared_pool(tmp_path):
    """A real Jupyter kernel holds a keep_warm pool; shutting the kernel down (as a notebook's 'Shut Down' or
    the end of `labkit run`) leaves no rank, no daemon a rank started, and no temporary folder."""
    manager = pytest.importorskip("jupyter_client.manager")
    km, kc = manager.start_new_kernel(kernel_name="python3", env=dict(os.environ, PYTHONPATH=str(REPO)))
    out = []
    try:
        reply = kc.execute_interactive(_KERNEL_CELL.format(tests=str(REPO / "tests"), pid_dir=str(tmp_path)),
                                       timeout=180, output_hook=lambda m: out.append(m["content"].get("text", "")))
        assert reply["content"]["status"] == "ok", reply["content"]
        info = json.loads("".join(out).strip().splitlines()[-1])
        kernel = psutil.Process(info["kernel"])
        tree = [p.pid for p in kernel.children(recursive=True)]
        kids = [p for f in tmp_path.glob("*.json") for p in json.loads(f.read_text())]
        run_dirs = list(Path(tempfile.gettempdir()).glob(f"labkit-launch-{info['kernel']}-*"))
        assert len(info["ranks"]) == 2 and len(kids) == 2 and len(run_dirs) == 1
    finally:
        proc = getattr(km.provisioner, "process", None)
        kc.stop_channels()
        km.shutdown_kernel(now=False)  # a shutdown request: the kernel exits through its exit hooks
    if proc is not None:
        assert proc.wait(timeout=10) == 0, "the kernel was killed, not shut down: its exit hooks did not run"
    alive = _wait_gone([*info["ranks"], *kids, *tree], run_dirs[0])
    assert not alive, f"left after the kernel shut down: {alive}"
    assert not run_dirs[0].exists()
