"""The launch supervisor: one small process per launch (or warm pool) that starts the ranks, reports their
exits, and kills everything they started when the launch ends — however it ends.

Why a separate process: a rank's own children (a ``subprocess``, a forked copy, a DataLoader worker, a
daemon that called ``setsid``) are not reached by the rank's ``PR_SET_PDEATHSIG``, and when the caller (a
notebook kernel) is SIGKILLed nothing in it runs. The supervisor

* is a Linux *child subreaper* (``PR_SET_CHILD_SUBREAPER``): any process descended from a rank whose
  parent dies is re-parented to the supervisor instead of to init, so it stays findable;
* starts each rank in its own session (process group = session = the rank's pid) and never reaps a rank
  before the end (``waitid(..., WNOWAIT)``), so the rank's pid cannot be reused while its group is killed;
* ends the launch on a ``kill`` command, on EOF of its control pipe (the caller exited or was SIGKILLed: the
  kernel closes the pipe), or when its parent changes: SIGKILL to every rank's process group and session,
  then, until it has no children left, SIGKILL to every child it has (descendants whose parents died were
  re-parented to it) — so nothing a rank started outlives the launch;
* samples each rank's memory high-water mark (``VmHWM`` in /proc/<pid>/status, every 0.2 s) and reports it
  with the exit status, so a SIGKILL can be told apart from an out-of-memory kill (launcher.py);
* removes the launch's private temporary folder when its caller died without doing so.

The ranks get ``PR_SET_PDEATHSIG`` = SIGKILL relative to the supervisor (worker.py). If the supervisor itself
is SIGKILLed, the ranks die with it, but processes they started are then re-parented to init: the one case
not covered (it needs an outside SIGKILL of a process that holds a few MB).

Fast start (``"fork"`` in the spec, when the rank template of zygote.py could not start): the supervisor
first imports what every rank imports (zygote.PRELOAD: torch,
torch.distributed, cloudpickle, labkit's worker: about 4 s of CPU on a laptop core), then *forks* each rank
from itself instead of starting a fresh interpreter, so N ranks pay that import once instead of N times. The
forked rank resets what it inherited (signal handlers, the wake-up fd, every descriptor but its own stdin /
stdout / stderr, the environment) and calls the same entry function the fresh interpreter would. The caller's
``sys.path`` (without the working directory, safepath.py) is put in place before the import, as the rank
would. If the import fails, ranks start as fresh interpreters (``posix_spawn``) as before; the caller can ask
for that with ``LABKIT_RANK_START=spawn``.

Protocol: the caller writes JSON lines to the supervisor's stdin (``{"cmd": "signal", "sig": 10}``,
``{"cmd": "kill"}``) and reads JSON lines from its stdout (``{"ev": "pid", "rank", "pid"}``,
``{"ev": "exit", "rank", "code", "hwm"}`` with ``code`` < 0 for a signal, ``{"ev": "done"}``).
Standard library only: it starts in a few tens of milliseconds.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import shutil
import signal
import sys
import time
import traceback

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
SAMPLE_S = 0.2
KILL_DEADLINE_S = 10.0


def prctl(option: int, value: int) -> bool:
    """``prctl(option, value)`` on Linux; False where it is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def set_process_name(name: str) -> None:
    """The name ``ps``/``top`` show for this process (Linux ``PR_SET_NAME``, at most 15 bytes); nothing
    elsewhere. Forked ranks keep their parent's command line, so this is how one tells them apart."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def hwm_bytes(pid: int) -> int | None:
    """Peak resident memory of a live process (VmHWM, bytes); None for a zombie or a vanished process."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    out: list[int] = []
    task_dir = f"/proc/{pid}/task"
    try:
        for tid in os.listdir(task_dir):
            with open(f"{task_dir}/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
        return out
    except (OSError, ValueError):
        pass
    for d in os.listdir("/proc"):  # kernels without /proc/<pid>/task/<tid>/children
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    return out


def session_members(sids: set[int]) -> list[int]:
    """Processes whose session id is in ``sids``."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if os.getsid(int(d)) in sids:
                    out.append(int(d))
            except OSError:
                pass
    return out


def _exit_code(pid: int) -> int | None:
    """The exit status of child ``pid`` without reaping it (None while it runs); < 0 for a signal."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return -int(signal.SIGKILL)
    if info is None or info.si_pid == 0:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def process_running(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True


class _Supervisor:
    def __init__(self, spec: dict):
        self.spec = spec
        self.parent = spec["parent_pid"]
        self.pids: dict[int, int] = {}
        self.live: set[int] = set()
        self.hwm: dict[int, int] = {}
        self.buf = b""
        self.forking = False

    def emit(self, **event) -> None:
        try:
            os.write(1, (json.dumps(event) + "\n").encode())
        except OSError:  # the caller is gone: keep going, the kill below still runs
            pass

    def preload(self) -> None:
        """Import what the ranks import, so that they can be forked from here (module docstring)."""
        fork = self.spec.get("fork")
        if not fork or not hasattr(os, "fork"):
            return
        for p in reversed(fork.get("sys_path", [])):
            if p not in sys.path:
                sys.path.insert(0, p)
        try:
            import warnings

            warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)  # 3.12+
            for name in fork.get("preload", []):
                importlib.import_module(name)
        except BaseException:  # noqa: BLE001 - any failure: start fresh interpreters instead
            return
        self.forking = True

    def fork_rank(self, r: int, rank: dict, env: dict, stdin: int) -> int:
        """Fork rank ``r`` from this (preloaded) process; the child runs the rank's entry and never returns."""
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            os.setsid()
            signal.set_wakeup_fd(-1)
            for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_DFL)
            os.dup2(stdin, 0)
            os.dup2(rank["stdout"], 1)
            os.dup2(rank["stderr"], 2)
            os.closerange(3, 1 << 16)  # the other ranks' pipes, our control pipe: as a fresh process has none
            os.environ.clear()
            os.environ.update(env)
            set_process_name(f"labkit-rank{r}")
            sys.path_importer_cache.clear()  # the template's view of sys.path folders (made in another folder,
            importlib.invalidate_caches()  # before files the caller wrote since) is not the rank's
            if "labkit.runtime.reset" in sys.modules:  # preloaded: torch too
                sys.modules["labkit.runtime.reset"].reseed_as_fresh_process()
            module, function, args = self.spec["fork"]["entries"][r]
            code = getattr(importlib.import_module(module), function)(list(args))
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - the rank's stderr is the place to say why
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code if isinstance(code, int) else 1)

    def start_ranks(self) -> None:
        env = dict(self.spec.get("env") or os.environ, LABKIT_SUPERVISOR_PID=str(os.getpid()))
        devnull = os.open(os.devnull, os.O_RDONLY)
        for r, rank in enumerate(self.spec["ranks"]):
            stdin = rank["stdin"] if rank.get("stdin") is not None else devnull
            if self.forking:
                pid = self.fork_rank(r, rank, env, stdin)
            else:
                actions = [(os.POSIX_SPAWN_DUP2, stdin, 0), (os.POSIX_SPAWN_DUP2, rank["stdout"], 1),
                           (os.POSIX_SPAWN_DUP2, rank["stderr"], 2)]
                pid = os.posix_spawn(rank["argv"][0], rank["argv"], env, file_actions=actions, setsid=True)
            self.pids[r] = pid
            self.live.add(r)
            self.emit(ev="pid", rank=r, pid=pid)
        os.close(devnull)
        for rank in self.spec["ranks"]:  # the ranks hold these now; our copies would keep their pipes open
            for k in ("stdin", "stdout", "stderr"):
                if rank.get(k) is not None:
                    try:
                        os.close(rank[k])
                    except OSError:
                        pass

    def sample(self) -> None:
        for r in list(self.live):
            h = hwm_bytes(self.pids[r])
            if h is not None:
                self.hwm[r] = h

    def check_exits(self) -> None:
        for r in sorted(self.live):
            code = _exit_code(self.pids[r])
            if code is not None:
                self.live.discard(r)
                self.emit(ev="exit", rank=r, code=code, hwm=self.hwm.get(r))

    def command(self, line: bytes) -> bool:
        """Handle one command; False means: end the launch."""
        try:
            cmd = json.loads(line)
        except ValueError:
            return True
        if cmd.get("cmd") == "kill":
            return False
        if cmd.get("cmd") == "signal":
            for r in sorted(self.live):
                try:
                    os.kill(self.pids[r], int(cmd["sig"]))
                except (OSError, ValueError, KeyError):
                    pass
        return True

    def serve(self) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: None)  # wakes select; the ppid check below ends us
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the caller, which sends "kill"
        self.preload()
        self.start_ranks()
        last = 0.0
        while True:
            try:
                ready, _, _ = select.select([0, wake_r], [], [], SAMPLE_S)
            except InterruptedError:
                ready = []
            if wake_r in ready:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
            if 0 in ready:
                try:
                    data = os.read(0, 65536)
                except OSError:
                    data = b""
                if not data:
                    break  # EOF: the caller exited or was killed
                self.buf += data
                stop = False
                while b"\n" in self.buf:
                    line, self.buf = self.buf.split(b"\n", 1)
                    if not self.command(line):
                        stop = True
                if stop:
                    break
            now = time.monotonic()
            if now - last >= SAMPLE_S:
                self.sample()
                last = now
            self.check_exits()
            if os.getppid() != self.parent:
                break
        self.kill_all()

    def kill_all(self) -> None:
        self.sample()
        sids = set(self.pids.values())
        for pid in sids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in session_members(sids):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.check_exits()  # exits seen now are reported with their real status (the kill is ours)
        me = os.getpid()
        deadline = time.monotonic() + KILL_DEADLINE_S
        while time.monotonic() < deadline:
            kids = children(me)
            for pid in kids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                while os.waitpid(-1, os.WNOHANG)[0] > 0:
                    pass
            except ChildProcessError:
                break  # no child left: everything a rank started is gone
            if not kids:
                time.sleep(0.002)
        self.emit(ev="done")
        run_dir = self.spec.get("run_dir")
        caller = self.spec.get("caller_pid")
        if run_dir and (not process_running(caller) if caller else os.getppid() != self.parent):
            shutil.rmtree(run_dir, ignore_errors=True)  # the caller died: nobody else will


def main(argv: list[str]) -> int:
    """``boot_argv("labkit.runtime.supervisor", "main", [SPEC_JSON_PATH])``."""
    with open(argv[0]) as f:
        spec = json.load(f)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != spec["parent_pid"]:
        return 1
    _Supervisor(spec).serve()
    return 0
