"""The launcher and its fault suite (gloo, world sizes 2 and 4).

Every fault test checks three things: the right error (rank named), the time it took (within the launch's
timeout + 5 s), and that no child process is left behind (psutil).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
import torch
import torch.distributed as dist

from labkit import launch
from labkit.runtime import zygote
from labkit.runtime.launcher import LaunchTimeout, RankFailed, ShipError, load_results

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def no_orphans():
    """After each test: no child process of the test process survives (waits up to 5 s for reaping)."""
    yield
    deadline = time.monotonic() + 5
    while True:
        kids = [p for p in psutil.Process().children(recursive=True)
                if p.status() != psutil.STATUS_ZOMBIE and p.pid != zygote.template_pid()]
        if not kids or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not kids, f"orphan processes left: {[(p.pid, p.cmdline()) for p in kids]}"


# ---------------------------------------------------------------------------------------------------
# rank functions (module level: shipped by reference; the notebook test covers by-value)
# ---------------------------------------------------------------------------------------------------
def report(ctx, scale, *, offset=0):
    t = torch.tensor([float(ctx.rank + 1)])
    with ctx.timer("all_reduce", "comm", step=0, nbytes=4):
        dist.all_reduce(t)
    with ctx.timer("work", "compute", step=0, microbatch=ctx.rank):
        pass
    return {"rank": ctx.rank, "world_size": ctx.world_size, "sum": t.item(), "value": scale * ctx.rank + offset,
            "backend": ctx.backend, "device": str(ctx.device), "threads": torch.get_num_threads(),
            "pid": os.getpid()}


def big_frame(ctx, rows):
    return pd.DataFrame({"rank": [ctx.rank] * rows, "x": torch.arange(rows, dtype=torch.float64).numpy()})


def raise_on_rank1(ctx):
    t = torch.ones(1)
    if ctx.rank == 1:
        raise ValueError("deliberate failure on rank one")
    dist.all_reduce(t)  # rank 0 blocks here until launch ends it
    return t.item()


def exit_on_rank1(ctx):
    if ctx.rank == 1:
        os._exit(3)
    dist.all_reduce(torch.ones(1))


def sigkill_rank1(ctx):
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(1))


def deadlock(ctx):
    if ctx.rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        buf = torch.zeros(1)
        dist.recv(buf, src=0)  # rank 0 never sends
    return "unreachable"


def unpicklable_result(ctx):
    return threading.Lock()


def sleeper(ctx, seconds):
    time.sleep(seconds)
    return ctx.rank


def trivial(ctx):
    return ctx.rank


# ---------------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world_size", [2, 4])
def test_results_in_rank_order_with_args_kwargs_and_timeline(world_size):
    res = launch(report, world_size, 10, offset=5, echo=False)
    assert [r["rank"] for r in res] == list(range(world_size))
    assert [r["value"] for r in res] == [10 * r + 5 for r in range(world_size)]
    assert all(r["sum"] == world_size * (world_size + 1) / 2 for r in res)
    assert all(r["backend"] == "gloo" and r["device"] == "cpu" for r in res)
    assert len({r["pid"] for r in res}) == world_size
    # threads: ranks share the cores instead of each taking all of them
    cores = len(os.sched_getaffinity(0))
    assert all(r["threads"] == max(1, cores // world_size) for r in res)
    assert res.world_size == world_size and res.backend == "gloo" and res.wall_s > 0
    tl = res.timeline
    assert sorted(tl["rank"].unique()) == list(range(world_size))
    assert set(tl["name"]) == {"all_reduce", "work"}
    assert (tl["end_ns"] >= tl["start_ns"]).all()
    work = tl[tl["name"] == "work"].sort_values("rank")
    assert work["microbatch"].tolist() == list(range(world_size))


def test_large_dataframe_result_comes_back():
    rows = 400_000  # ~6.4 MB per rank
    res = launch(big_frame, 2, rows, echo=False)
    assert all(isinstance(df, pd.DataFrame) and len(df) == rows for df in res)
    assert res[1]["rank"].eq(1).all() and res[0]["x"].iloc[-1] == rows - 1


def test_function_by_name_string():
    res = launch("labkit.experiments:hello", 2, echo=False)
    assert [r["rank"] for r in res] == [0, 1]
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        launch("labkit.experiments:nope", 2)
    with pytest.raises(ValueError, match="cannot import module 'nope.nope'"):
        launch("nope.nope:f", 2)


def test_two_launches_at_the_same_time():
    results, errors = {}, []

    def go(key):
        try:
            results[key] = list(launch(report, 2, key, echo=False))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=go, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [r["value"] for r in results[1]] == [0, 1] and [r["value"] for r in results[2]] == [0, 2]


@pytest.mark.slow
def test_twenty_reruns_in_one_process():
    for i in range(20):
        assert list(launch(trivial, 2, echo=False)) == [0, 1], f"re-run {i}"
    assert not dist.is_initialized(), "the caller must never hold a process group"


# ---------------------------------------------------------------------------------------------------
# faults
# ---------------------------------------------------------------------------------------------------
def _timed(fn, *args, **kwargs):
    t0 = time.monotonic()
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return info.value, time.monotonic() - t0


@pytest.mark.parametrize("world_size", [2, 4])
def test_rank_raises_while_others_wait_in_all_reduce(world_size):
    err, elapsed = _timed(launch, raise_on_rank1, world_size, timeout_s=60, echo=False)
    assert isinstance(err, RankFailed) and isinstance(err, RuntimeError)
    assert err.rank == 1
    assert "rank 1" in str(err) and "ValueError" in str(err) and "deliberate failure on rank one" in str(err)
    assert "raise ValueError" in err.traceback_text  # source line of the failing rank
    assert elapsed < 60 + 5 and elapsed < 20  # within seconds, not at the timeout


def test_rank_exits_without_exception():
    err, elapsed = _timed(launch, exit_on_rank1, 2, timeout_s=60, echo=False)
    assert isinstance(err, RankFailed) and err.rank == 1 and err.exitcode == 3
    assert "exited with code 3" in str(err)
    assert elapsed < 20


def test_rank_killed_by_signal():
    err, elapsed = _timed(launch, sigkill_rank1, 2, timeout_s=60, echo=False)
    assert isinstance(err, RankFailed) and err.rank == 1 and err.signal_name == "SIGKILL"
    assert "SIGKILL" in str(err)
    assert elapsed < 20


def test_deadlock_ends_at_timeout_with_stacks():
    timeout = 12  # long enough for both ranks to reach the rank function on a loaded 2-core machine
    err, elapsed = _timed(launch, deadlock, 2, timeout_s=timeout, echo=False)
    assert isinstance(err, LaunchTimeout) and isinstance(err, RuntimeError)
    assert timeout <= elapsed < timeout + 5
    assert set(err.stacks) == {0, 1}
    assert "deadlock" in err.stacks[0] and "deadlock" in err.stacks[1]  # the rank function is on each stack
    assert f"timed out after {timeout} s" in str(err)
    assert "Every rank was inside the rank function" in str(err)


def test_timeout_during_start_up_says_so():
    err, elapsed = _timed(launch, deadlock, 2, timeout_s=0.001, echo=False)
    assert isinstance(err, LaunchTimeout) and "had not reached the rank function yet" in str(err)
    assert elapsed < 5


def test_stacks_of_a_by_value_function_show_its_source():
    ns = {}
    src = "import time\ndef sleepy(ctx):\n    time.sleep(60)\n"
    path = "/tmp/labkit_test_sleepy_cell.py"  # like a notebook cell: a file linecache can read here
    with open(path, "w") as f:
        f.write(src)
    exec(compile(src, path, "exec"), ns)
    fn = ns["sleepy"]
    fn.__module__ = "__main__"  # shipped by value: the rank sees <dynamic-code>
    err, _ = _timed(launch, fn, 2, timeout_s=12, echo=False)
    assert isinstance(err, LaunchTimeout)
    assert f'File "{path}", line 3 in sleepy' in err.stacks[0] and "time.sleep(60)" in err.stacks[0]
    assert "<dynamic-code>" not in str(err)


def test_unpicklable_argument_raises_before_any_process():
    lock = threading.Lock()
    t0 = time.monotonic()
    with pytest.raises(ShipError, match=r"args\[0\].*_thread.lock") as info:
        launch(sleeper, 2, lock)
    assert isinstance(info.value, ValueError)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(ShipError, match=r"kwargs\['seconds'\]\['inner'\]"):
        launch(sleeper, 2, seconds={"inner": lock})


def test_unpicklable_captured_global_is_named():
    ns = {"threading": threading}
    exec("import threading\nLOCK = threading.Lock()\ndef uses_lock(ctx):\n    return LOCK.locked()\n", ns)
    fn = ns["uses_lock"]
    fn.__module__ = "__main__"  # as in a notebook: shipped by value with its globals
    with pytest.raises(ShipError, match=r"fn uses global 'LOCK'"):
        launch(fn, 2)


def test_unpicklable_result_names_rank_and_type():
    err, elapsed = _timed(launch, unpicklable_result, 2, timeout_s=60, echo=False)
    assert isinstance(err, RankFailed) and err.rank in (0, 1)  # both fail alike; the earlier one is named
    assert f"rank {err.rank} returned a value of type lock that cannot be pickled" in str(err)
    assert elapsed < 20


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size=0"):
        launch(trivial, 0)
    with pytest.raises(ValueError, match="backend='mpi'"):
        launch(trivial, 2, backend="mpi")
    with pytest.raises(ValueError, match="one GPU per rank"):
        launch(trivial, 2, backend="nccl")
    with pytest.raises(ValueError, match="timeout_s"):
        launch(trivial, 2, timeout_s=0)
    with pytest.raises(ValueError, match="start_method='fork' is not supported.*spawn"):
        launch(trivial, 2, start_method="fork")
    with pytest.raises(ValueError, match="not callable"):
        launch(42, 2)


_CALLER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from labkit import launch
    from test_launch import sleeper
    try:
        launch(sleeper, 2, 60, timeout_s=120, echo=False)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
    print("finished", flush=True)
""")


def _start_caller():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), env_pp] if (env_pp := os.environ.get(
        "PYTHONPATH")) else [str(REPO)]))
    proc = subprocess.Popen([sys.executable, "-c", _CALLER.format(tests=str(REPO / "tests"))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    ps = psutil.Process(proc.pid)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until both ranks run
        kids = ps.children(recursive=True)
        names = [k.name() for k in kids]  # forked ranks are named labkit-rank<r>; fresh interpreters run rank_main
        if sum(n.startswith("labkit-rank") or (not n.startswith("labkit-") and "rank_main" in " ".join(k.cmdline()))
               for n, k in zip(names, kids)) == 2:
            return proc, kids
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    tree = [(k.pid, k.name(), k.status()) for k in ps.children(recursive=True)]
    proc.kill()
    raise AssertionError(f"ranks did not start: {tree} {proc.communicate()[1][-3000:]}")


def test_keyboard_interrupt_in_caller_ends_every_rank():
    proc, kids = _start_caller()
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in out  # counted as failed, never as success
    gone, alive = psutil.wait_procs(kids, timeout=5)
    assert not alive, f"ranks survived the interrupt: {alive}"
    assert time.monotonic() - t0 < 10


def test_caller_killed_takes_its_ranks_along():
    proc, kids = _start_caller()
    proc.kill()  # like a kernel killed mid-launch: no cleanup code runs in the caller
    proc.communicate(timeout=30)
    gone, alive = psutil.wait_procs(kids, timeout=5)
    assert not alive, f"orphaned ranks: {alive}"


# ---------------------------------------------------------------------------------------------------
# torchrun entry
# ---------------------------------------------------------------------------------------------------
def test_same_function_under_torchrun(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed next to this python")
    out = tmp_path / "hello"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "labkit.runtime.worker",
                           "labkit.experiments:straggler_all_reduce", "--kwargs", '{"work_ms": 5, "steps": 1}',
                           "--out", str(out)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = load_results(out)
    assert [r["rank"] for r in res] == [0, 1] and res.backend == "gloo"
    assert set(res.timeline["name"]) == {"work", "all_reduce"}
    with pytest.raises(ValueError, match="no torchrun results"):
        load_results(tmp_path)


def test_worker_kwargs_must_be_a_json_object():
    env = dict(os.environ, PYTHONPATH=str(REPO), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="1")
    proc = subprocess.run([sys.executable, "-m", "labkit.runtime.worker", "labkit.experiments:hello", "--kwargs",
                           "[1, 2]"], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "--kwargs must be a JSON object" in proc.stderr


def test_worker_outside_torchrun_says_how():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-m", "labkit.runtime.worker", "labkit.experiments:hello"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2 and "not under torchrun" in proc.stderr


# ---------------------------------------------------------------------------------------------------
# GPU path (skipped without CUDA): NCCL with one rank per GPU, the same code
# ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nccl_world_size_one_on_gpu():
    res = launch(report, 1, 3, backend="auto", echo=False)
    assert res.backend == "nccl" and res[0]["device"] == "cuda:0" and res[0]["sum"] == 1.0
    assert len(res.timeline) == 2


def test_launch_result_timeline_is_built_when_first_read_and_pickles():
    import pickle

    from labkit.runtime.launcher import LaunchResult

    built = []

    def make():
        built.append(1)
        return pd.DataFrame({"rank": [0]})

    res = LaunchResult([1, 2], make, 2, "gloo", 0.1)
    assert built == []  # a warm run that never reads its timeline never builds it
    assert res.timeline is res.timeline and built == [1]
    back = pickle.loads(pickle.dumps(LaunchResult([1], make, 1, "gloo", 0.1)))
    assert list(back) == [1] and back.timeline.equals(pd.DataFrame({"rank": [0]})) and back.world_size == 1
    old = LaunchResult.__new__(LaunchResult)  # pickled before the timeline became lazy: state has "timeline"
    old.__setstate__({"timeline": "df", "world_size": 1, "backend": "gloo", "wall_s": 0.0})
    assert old.timeline == "df"
