"""Issue 17, one test (or more) per kind: nothing of a launch listens beyond loopback; ranks never import from the
working directory; nothing a rank started outlives the launch; world sizes beyond host memory are refused;
validation is bounded in time; OOM kills are named; leftovers are cleaned; torchrun results are data.

Launches stay at world_size 2 (this suite runs on 2 shared cores).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from labkit import launch
from labkit.checks import MAX_COUNT, check_divides, divisors, positive_int
from labkit.runtime import limits, records, zygote
from labkit.runtime.launcher import RankFailed, load_results, remove_stale_launch_dirs
from labkit.runtime.rendezvous import is_loopback, listening_addresses

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process trees, /proc and prctl are Linux")


# ---------------------------------------------------------------------------------------------------
# rank functions
# ---------------------------------------------------------------------------------------------------
def survey(ctx):
    """After the group exists on every rank: each process of the launch (this rank, its peers, the supervisor,
    the caller) with the sockets it listens on, and this rank's memory."""
    dist.barrier()
    procs = {}
    if ctx.rank == 0:
        sup = psutil.Process(os.getppid())
        caller = sup.parent()
        for p in [caller, sup, *sup.children(recursive=True)]:
            procs[p.pid] = {"cmd": " ".join(p.cmdline())[-60:], "listen": listening_addresses(p.pid)}
    dist.barrier()
    mem = psutil.Process().memory_full_info()
    return {"procs": procs, "rss": mem.rss, "uss": mem.uss}


def start_children(ctx, pid_dir, mode):
    """Start every kind of child a rank can have, write their pids, then end as ``mode`` says."""
    import torch.utils.data as tud

    kids = [subprocess.Popen(["sleep", "600"]).pid,  # same process group as the rank
            subprocess.Popen(["sleep", "601"], start_new_session=True).pid]  # a daemon in its own session
    # a double fork: the middle process exits at once, the grandchild is re-parented (to the supervisor)
    mid = subprocess.Popen([sys.executable, "-c", "import subprocess,sys; p=subprocess.Popen(['sleep','602'], "
                            "start_new_session=True); print(p.pid); sys.stdout.flush()"], stdout=subprocess.PIPE)
    kids.append(int(mid.stdout.readline()))
    mid.wait()
    pid = os.fork()
    if pid == 0:  # a forked copy of the rank
        time.sleep(600)
        os._exit(0)
    kids.append(pid)
    loader = iter(tud.DataLoader(list(range(8)), batch_size=2, num_workers=1, persistent_workers=True))
    next(loader)
    kids += [w.pid for w in loader._workers]
    Path(pid_dir, f"rank{ctx.rank}.json").write_text(json.dumps(kids))
    dist.barrier()
    if mode == "raise" and ctx.rank == 1:
        raise RuntimeError("deliberate failure with children running")
    if mode == "sigkill" and ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "hang":
        time.sleep(600)
    dist.barrier()
    return len(kids)


def sigkill_after_alloc(ctx, mb):
    if ctx.rank == 1:
        block = torch.ones(mb * 2**20 // 4)  # touched: resident
        time.sleep(0.8)  # the supervisor samples VmHWM every 0.2 s
        del block
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _alive(pids):
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _orphans(pid_dir: Path, timeout_s: float = 10.0) -> list[int]:
    pids = [p for f in sorted(pid_dir.glob("rank*.json")) for p in json.loads(f.read_text())]
    assert len(pids) >= 2 * 5 or len(pids) == 5, f"the rank function did not record its children: {pids}"
    return _still_alive(pids, timeout_s)


def _still_alive(pids, timeout_s: float = 10.0) -> list[int]:
    """The processes of ``pids`` still running ``timeout_s`` after now (the supervisor ends its ranks and
    removes the launch's folder before it exits itself, so exiting takes a moment); those are killed."""
    deadline = time.monotonic() + timeout_s
    while (alive := _alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in alive:  # never leave them behind, even when the assertion fails
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return alive


# ---------------------------------------------------------------------------------------------------
# 1. exposed store: nothing of a launch listens beyond loopback;  4. the footprint the cap assumes
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def surveyed():
    return launch(survey, 2, echo=False, timeout_s=120)


def test_nothing_of_a_launch_listens_beyond_loopback(surveyed):
    procs = surveyed[0]["procs"]
    assert len(procs) == 4  # the caller, the supervisor, two ranks
    sockets = [(pid, addr, port) for pid, info in procs.items() for addr, port in info["listen"]]
    assert sockets, "rank 0's store must be listening somewhere"
    exposed = [s for s in sockets if not is_loopback(s[1])]
    assert not exposed, f"listening beyond loopback: {exposed}"


def test_rank_footprint_is_what_the_cap_assumes(surveyed):
    for r in surveyed:  # measured RSS of a rank with torch and a gloo group, under the assumed footprint
        assert r["rss"] < limits.RANK_FOOTPRINT_BYTES, r


def test_loopback_helpers():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.1.2.3")
    from labkit.runtime.rendezvous import listen_socket

    s = listen_socket("127.0.0.1")
    try:
        assert ("127.0.0.1", s.getsockname()[1]) in listening_addresses()
    finally:
        s.close()


# ---------------------------------------------------------------------------------------------------
# 2. planted module: never imported by the ranks; a helper module next to the notebook still works
# ---------------------------------------------------------------------------------------------------
PLANT = "open({marker!r}, 'a').write(__name__ + ' imported in ' + str(__import__('os').getpid()) + '\\n')\n"


def _plant(folder: Path, names=("cloudpickle", "torch", "json", "labkit")) -> Path:
    marker = folder / "PLANTED_RAN"
    for name in names:
        (folder / f"{name}.py").write_text(PLANT.format(marker=str(marker)))
    return marker


def test_planted_modules_in_cwd_are_not_imported_and_cwd_helpers_still_ship(tmp_path, monkeypatch):
    marker = _plant(tmp_path)
    (tmp_path / "helper_mod_h17.py").write_text("def double(x):\n    return 2 * x\n")
    (tmp_path / "user_mod_h17.py").write_text(
        "import os\nimport helper_mod_h17\n\ndef rank_fn(ctx):\n"
        "    return helper_mod_h17.double(ctx.rank), os.getcwd()\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend("")  # as in a notebook kernel: '' (the cwd) first on sys.path
    import user_mod_h17

    try:
        res = launch(user_mod_h17.rank_fn, 2, echo=False, timeout_s=120)
    finally:
        for m in ("user_mod_h17", "helper_mod_h17"):
            sys.modules.pop(m, None)
    assert [r[0] for r in res] == [0, 2]  # the cwd module ran, shipped by value
    assert all(os.path.samefile(r[1], tmp_path) for r in res)  # relative paths mean what they mean here
    assert not marker.exists(), marker.read_text()


@pytest.mark.slow
def test_labkit_doctor_in_a_planted_folder(tmp_path):
    marker = _plant(tmp_path, names=("cloudpickle", "torch", "json", "argparse", "pandas"))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "labkit", "doctor", "--world-size", "2"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "all_reduce" in proc.stdout
    assert not marker.exists(), marker.read_text()


@pytest.mark.slow
def test_torchrun_ranks_in_a_planted_folder(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed next to this python")
    marker = _plant(tmp_path, names=("cloudpickle", "json", "argparse"))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "labkit.runtime.worker",
                           "labkit.experiments:hello", "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["rank"] for r in load_results(out)] == [0, 1]
    assert not marker.exists(), marker.read_text()


def test_shipped_path_drops_the_working_directory(tmp_path):
    from labkit.runtime.safepath import rank_pythonpath, shipped_sys_path

    cwd = str(tmp_path)
    assert shipped_sys_path(["", ".", cwd, cwd + "/", "/opt/x"], cwd=cwd) == ["/opt/x"]
    assert rank_pythonpath(f".:{cwd}:/opt/y", cwd=cwd) == "/opt/y" and rank_pythonpath("", cwd=cwd) is None


# ---------------------------------------------------------------------------------------------------
# 3. orphans: 0 after every way a launch ends
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["return", "raise", "sigkill"])
def test_no_process_a_rank_started_outlives_the_launch(tmp_path, mode):
    if mode == "return":
        assert list(launch(start_children, 2, str(tmp_path), mode, echo=False, timeout_s=120)) == [5, 5]
    else:
        with pytest.raises(RankFailed) as info:
            launch(start_children, 2, str(tmp_path), mode, echo=False, timeout_s=120)
        assert info.value.rank == 1
    assert _orphans(tmp_path) == []


def test_no_orphans_after_a_timeout(tmp_path):
    from labkit.runtime.launcher import LaunchTimeout

    with pytest.raises(LaunchTimeout):
        launch(start_children, 2, str(tmp_path), "hang", echo=False, timeout_s=40)
    assert _orphans(tmp_path) == []


_CALLER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from labkit import launch
    from test_hardening import start_children
    launch(start_children, 2, {pid_dir!r}, "hang", timeout_s=300, echo=False)
""")


def _sigkill_caller(code: str, pid_dir: Path, n_files: int = 2, timeout_s: float = 120):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while len(list(pid_dir.glob("rank*.json"))) < n_files:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the caller did not get its ranks going: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.1)
    time.sleep(0.5)
    tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    proc.kill()  # like a notebook kernel SIGKILLed mid-launch: no cleanup code runs in it
    proc.wait(timeout=30)
    return proc.pid, tree


def test_no_orphans_when_the_caller_is_sigkilled(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    caller, tree = _sigkill_caller(_CALLER.format(tests=str(REPO / "tests"), pid_dir=str(pid_dir)), pid_dir)
    assert _orphans(pid_dir) == []
    assert _still_alive(tree) == []  # supervisor and ranks too, within 10 s
    # 8. and the launch's private folder went with them (removed by the supervisor)
    assert not list(Path(tempfile.gettempdir()).glob(f"labkit-launch-{caller}-*"))


# ---------------------------------------------------------------------------------------------------
# 4. world-size cap from host memory
# ---------------------------------------------------------------------------------------------------
def trivial(ctx):
    return ctx.rank


def test_world_size_beyond_memory_is_refused_before_anything_starts():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"world_size=1000 does not fit.*the largest world_size that fits is \d+"):
        launch(trivial, 1000)
    assert time.perf_counter() - t0 < 1.0
    assert {p.pid for p in psutil.Process().children(recursive=True)} - {zygote.template_pid()} == before - {
        zygote.template_pid()}


def test_sixteen_emulated_ranks_stay_possible():
    avail = limits.available_bytes()
    if avail is None or avail < 16 * limits.RANK_FOOTPRINT_BYTES:
        pytest.skip(f"only {avail} bytes available here")
    limits.check_world_size(16)  # a 24 GiB laptop with >= 8 GiB free holds 16 ranks


def test_cap_is_overridable(monkeypatch):
    monkeypatch.setattr(limits, "available_bytes", lambda: limits.RANK_FOOTPRINT_BYTES * 3 // 2)
    with pytest.raises(ValueError, match="the largest world_size that fits is 1"):
        launch(trivial, 2)
    assert list(launch(trivial, 2, max_world_size=2, echo=False)) == [0, 1]
    # the command line has no max_world_size option: it is told of the environment variable only
    with pytest.raises(ValueError, match=r"fits is 1 \(to launch anyway set LABKIT_MAX_WORLD_SIZE=2\)$"):
        limits.check_world_size(2, name="-p world_size")
    with pytest.raises(ValueError, match=r"fits is 1$"):  # a typo (10**30 ranks): no override offered
        limits.check_world_size(10**30)
    monkeypatch.setenv(limits.ENV_MAX_WORLD_SIZE, "2")
    limits.check_world_size(2)
    with pytest.raises(ValueError, match="above LABKIT_MAX_WORLD_SIZE=2"):
        limits.check_world_size(3)
    monkeypatch.setenv(limits.ENV_MAX_WORLD_SIZE, "lots")
    with pytest.raises(ValueError, match="LABKIT_MAX_WORLD_SIZE='lots' must be an integer"):
        limits.check_world_size(2)


@pytest.mark.parametrize("argv, needle", [
    (["doctor", "--world-size", "1000"], "--world-size=1000 does not fit"),
    (["bench", "collectives", "--world-size", "1000"], "world_size=1000 does not fit"),
    (["run", "--chapters", "00", "-p", "world_size=1000"], "-p world_size=1000 does not fit"),
    (["run", "-p", "world_size=abc"], "-p world_size='abc' must be an integer"),
])
def test_cli_refuses_world_sizes_beyond_memory(argv, needle, capsys):
    from labkit.cli import main

    t0 = time.perf_counter()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err
    assert time.perf_counter() - t0 < 5


# ---------------------------------------------------------------------------------------------------
# 5. bounded-time validation
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [10**18, 2**53, 2**40 + 1, 10**400])
def test_absurd_magnitudes_are_refused_at_once(n):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=f"too large: labkit accepts at most {MAX_COUNT}"):
        divisors(n)
    with pytest.raises(ValueError, match="too large"):
        check_divides("tp", 7, "n_heads", n * 7 + 1)
    with pytest.raises(ValueError, match="too large"):
        positive_int("gpus", n, maximum=MAX_COUNT)
    assert time.perf_counter() - t0 < 0.1


def test_the_bound_itself_is_fast():
    t0 = time.perf_counter()
    assert divisors(2**40)[-1] == 2**40 and len(divisors(2**40)) == 41
    assert time.perf_counter() - t0 < 1.0
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    check_divides("tp", 2**39, "n", 2**60)  # divisible: no search, no bound needed


# ---------------------------------------------------------------------------------------------------
# 7. OOM named
# ---------------------------------------------------------------------------------------------------
def test_sigkill_with_a_moving_oom_counter_is_named_out_of_memory(monkeypatch):
    """The seam: the OOM counters (cgroup memory.events / memory.oom_control and /proc/vmstat) are read through
    limits.oom_kill_counts; here they move by one during the run, as when the kernel's OOM killer acts. The rank
    really allocates 200 MiB and is really SIGKILLed; its high-water mark is really sampled. What this does not
    show: the kernel's OOM killer itself (that needs a memory limit this test cannot impose)."""
    readings = iter([{"cgroup": 3, "system": 7}])
    monkeypatch.setattr(limits, "oom_kill_counts", lambda: next(readings, {"cgroup": 4, "system": 8}))
    with pytest.raises(RankFailed) as info:
        launch(sigkill_after_alloc, 2, 200, echo=False, timeout_s=120)
    msg = str(info.value).splitlines()[0]
    assert info.value.rank == 1 and info.value.signal_name == "SIGKILL"
    assert "out of memory: the kernel's OOM killer ended it (cgroup oom_kill 3 -> 4)" in msg, msg
    hwm = float(msg.split("high-water mark was ")[1].split(" GiB")[0])
    assert 0.19 < hwm < 0.5, msg  # 200 MiB block + the rank itself


def test_sigkill_without_oom_says_so():
    with pytest.raises(RankFailed) as info:
        launch(sigkill_after_alloc, 2, 1, echo=False, timeout_s=120)
    msg = str(info.value).splitlines()[0]
    counters = limits.oom_kill_counts()
    if counters["cgroup"] is None and counters["system"] is None:
        assert "not known whether by the OOM killer" in msg
    else:
        assert "not by the OOM killer" in msg or "probably out of memory" in msg, msg  # others share the machine
    assert "high-water mark was" in msg


def test_describe_sigkill_wording():
    gib = limits.GiB
    assert "cgroup oom_kill 0 -> 2" in limits.describe_sigkill({"cgroup": 0}, {"cgroup": 2}, 3 * gib)
    assert "3.00 GiB" in limits.describe_sigkill({"cgroup": 0}, {"cgroup": 2}, 3 * gib)
    assert "probably out of memory" in limits.describe_sigkill({"system": 1}, {"system": 2}, None)
    assert "no OOM counter" in limits.describe_sigkill({}, {}, None)


# ---------------------------------------------------------------------------------------------------
# 8. leftovers
# ---------------------------------------------------------------------------------------------------
def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_stale_record_temp_folders_are_removed_on_the_next_write_or_load(tmp_path):
    dead = tmp_path / ".tmp-20260101T000000_x_dead"
    dead.mkdir()
    (dead / ".owner.json").write_text(json.dumps({"host": __import__("socket").gethostname(), "pid": _dead_pid()}))
    live = tmp_path / ".tmp-20260101T000000_x_live"
    live.mkdir()
    (live / ".owner.json").write_text(json.dumps({"host": __import__("socket").gethostname(), "pid": os.getpid()}))
    old = tmp_path / ".tmp-20260101T000000_x_old"  # no owner (older labkit), last changed long ago
    old.mkdir()
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    path = records.save("x", root=tmp_path)
    assert not dead.exists() and not old.exists() and live.exists()
    assert not (path / ".owner.json").exists()  # the finished record carries no owner file
    live_old = live.rename(tmp_path / ".tmp-20260101T000000_x_liveold")
    os.utime(live_old, (time.time() - 2 * records.STALE_TMP_S,) * 2)
    records.load(path)
    assert not live_old.exists()  # older than any real write: abandoned whoever owns it


def test_launch_folders_of_dead_owners_are_removed_by_the_next_launch(tmp_path):
    dead_pid = _dead_pid()
    dead = tmp_path / f"labkit-launch-{dead_pid}-abc"
    dead.mkdir()
    (dead / "spec.json").write_text(json.dumps({"parent_pid": dead_pid}))
    live = tmp_path / f"labkit-launch-{os.getpid()}-def"
    live.mkdir()
    fresh = tmp_path / f"labkit-launch-{os.getpid()}-ghi"  # being created: no spec.json yet
    fresh.mkdir()
    old_style = tmp_path / "labkit-launch-xyz"
    old_style.mkdir()
    (old_style / "spec.json").write_text(json.dumps({"parent_pid": dead_pid}))
    other = tmp_path / "unrelated-dir"
    other.mkdir()
    removed = remove_stale_launch_dirs(tmp_path)
    assert sorted(removed) == sorted([dead, old_style])
    assert live.exists() and fresh.exists() and other.exists()


# ---------------------------------------------------------------------------------------------------
# 9. torchrun results are data: a shared folder cannot run code on load
# ---------------------------------------------------------------------------------------------------
class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _run_dir(tmp_path, fmt: str, payload, name: str = "") -> Path:
    out = tmp_path / (name or fmt)
    out.mkdir()
    (out / "meta.json").write_text(json.dumps({"world_size": 1, "backend": "gloo"}))
    if fmt == "pt":
        buf = io.BytesIO()
        torch.save(payload, buf)
        (out / "rank0.pt").write_bytes(buf.getvalue())
    else:
        import cloudpickle

        (out / "rank0.pkl").write_bytes(cloudpickle.dumps(payload))
    return out


def test_load_results_reads_data_and_refuses_code(tmp_path):
    import numpy as np

    good = {"result": {"loss": [1.5, np.float64(2.0)], "t": torch.ones(2), "a": np.arange(3)}, "events": [],
            "offset_ns": 0}
    res = load_results(_run_dir(tmp_path, "pt", good))
    assert res[0]["loss"][1] == 2.0 and res[0]["t"].tolist() == [1.0, 1.0] and res[0]["a"].tolist() == [0, 1, 2]
    marker = tmp_path / "PWNED"
    evil = {"result": _Evil(marker), "events": [], "offset_ns": 0}
    with pytest.raises(Exception, match="(?i)weights.only|unsupported|global"):
        load_results(_run_dir(tmp_path, "pt", evil, name="evil"))
    assert not marker.exists()
    pickled = _run_dir(tmp_path, "pkl", {"result": 7, "events": [], "offset_ns": 0})
    with pytest.raises(ValueError, match="allow_pickle=True"):
        load_results(pickled)
    assert list(load_results(pickled, allow_pickle=True)) == [7]


def test_torchrun_rank_refuses_results_that_are_not_data_unless_asked(tmp_path):
    import pandas as pd

    from labkit.runtime.timeline import Timeline
    from labkit.runtime.worker import _write_torchrun_result

    class Ctx:
        timeline = Timeline(0)

    with pytest.raises(TypeError, match="--pickle-results"):
        _write_torchrun_result(tmp_path, 0, Ctx(), pd.DataFrame({"a": [1]}), allow_pickle=False)
    assert not list(tmp_path.iterdir())
    assert _write_torchrun_result(tmp_path, 0, Ctx(), pd.DataFrame({"a": [1]}), allow_pickle=True) == "pickle"
    assert _write_torchrun_result(tmp_path, 1, Ctx(), {"a": 1}, allow_pickle=False) == "torch-weights-only"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.pkl", "rank1.pt"]
