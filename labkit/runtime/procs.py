"""The caller's side of a set of rank processes: start them under a supervisor (supervisor.py), forward their
output, follow their exits, signal them, and end them — with everything they started.

Used by :func:`labkit.runtime.launcher.launch` (one run, then :meth:`RankProcs.kill`) and by
:class:`labkit.runtime.pool.Pool` (many runs on the same processes).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from labkit.runtime.safepath import boot_argv


class _Pump:
    """Forward one rank's stdout or stderr to ours, prefixed ``[rank r]``, keeping the last lines."""

    def __init__(self, rank: int, fd: int, to_stderr: bool, owner: RankProcs):
        self.rank, self.fd, self.to_stderr, self.owner = rank, fd, to_stderr, owner
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"labkit-pump-{rank}")
        self.thread.start()

    def _run(self) -> None:
        with os.fdopen(self.fd, "rb", buffering=0) as pipe:
            buf = b""
            while True:
                try:
                    data = pipe.read(65536)
                except OSError:
                    data = b""
                if not data:
                    if buf:
                        self._line(buf)
                    return
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self._line(line + b"\n")

    def _line(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace")
        if self.to_stderr:
            self.tail.append(line)
        if self.owner.echo:
            try:
                # read sys.stdout/err at call time: Jupyter swaps them per cell
                (sys.stderr if self.to_stderr else sys.stdout).write(f"[rank {self.rank}] {line}")
            except Exception:  # noqa: BLE001 - a closed sink must not kill the pump
                pass


class _ForkedSupervisor:
    """A launch supervisor forked by the rank template (zygote.py), seen through the part of
    ``subprocess.Popen`` that :class:`RankProcs` uses: ``pid``, ``stdin``, ``stdout``, ``wait``, ``kill``."""

    def __init__(self, template, spec_path: str, child_fds: list[int]):
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            self.pid = template.fork_supervisor(spec_path, [in_r, out_w, *child_fds])
        except BaseException:
            os.close(in_w)
            os.close(out_r)
            raise
        finally:
            os.close(in_r)
            os.close(out_w)
        self.stdin = os.fdopen(in_w, "wb")
        self.stdout = os.fdopen(out_r, "rb")

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        from labkit.runtime.supervisor import process_running

        while process_running(self.pid):
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("labkit supervisor", timeout)
            time.sleep(0.005)

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass


class RankProcs:
    """``world_size`` rank processes started by one supervisor.

    Args:
        argvs: one command line per rank.
        env: the ranks' environment.
        cwd: where the supervisor and the ranks start (the launch's private folder).
        spec_path: where to write the supervisor's spec (inside ``cwd``).
        echo: forward the ranks' output (changeable later through :attr:`echo`).
        with_stdin: give each rank a pipe on stdin (:meth:`send` writes a line to it); else /dev/null.
        fork: ``{"sys_path", "preload", "entries"}``: the supervisor imports ``preload`` once and forks each
            rank, which calls ``entries[r]`` (``[module, function, args]``, what ``argvs[r]`` would run) —
            supervisor.py's fast start; None: every rank is a fresh interpreter.
    """

    def __init__(self, argvs: list[list[str]], env: dict, cwd: Path, spec_path: Path, *, echo: bool = True,
                 with_stdin: bool = False, fork: dict | None = None):
        self.world_size = len(argvs)
        self.echo = echo
        self.codes: dict[int, int] = {}
        self.hwm: dict[int, int | None] = {}
        self.pids: dict[int, int] = {}
        self._cond = threading.Condition()
        self._done = False
        self._stdin: dict[int, int] = {}
        child_fds, ranks, self.pumps = [], [], {}
        for r, argv in enumerate(argvs):
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            entry = {"argv": argv, "stdout": out_w, "stderr": err_w, "stdin": None}
            child_fds += [out_w, err_w]
            if with_stdin:
                in_r, in_w = os.pipe()
                entry["stdin"] = in_r
                child_fds.append(in_r)
                self._stdin[r] = in_w
            ranks.append(entry)
            self.pumps[r] = (_Pump(r, out_r, False, self), _Pump(r, err_r, True, self))
        spec_path.write_text(json.dumps({"parent_pid": os.getpid(), "caller_pid": os.getpid(), "ranks": ranks,
                                         "run_dir": str(cwd), "fork": fork, "env": env}))
        try:
            self.sup = None
            if fork is not None:  # forked by the rank template (zygote.py), which imported torch once
                from labkit.runtime import zygote

                template = zygote.get(env, fork["sys_path"])
                if template is not None:
                    try:
                        self.sup = _ForkedSupervisor(template, str(spec_path), child_fds)
                    except RuntimeError as e:  # the template died: start the supervisor ourselves
                        print(f"labkit: {e}; starting the launch's supervisor directly", file=sys.stderr)
            if self.sup is None:
                self.sup = subprocess.Popen(boot_argv("labkit.runtime.supervisor", "main", [str(spec_path)]),
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
                                            cwd=str(cwd), env=env, pass_fds=child_fds, start_new_session=True)
        finally:
            for fd in child_fds:
                os.close(fd)
        self._reader = threading.Thread(target=self._read_events, daemon=True, name="labkit-supervisor")
        self._reader.start()

    # -- events ----------------------------------------------------------------------------------------
    def _read_events(self) -> None:
        for raw in iter(self.sup.stdout.readline, b""):
            try:
                ev = json.loads(raw)
            except ValueError:
                continue
            with self._cond:
                if ev.get("ev") == "pid":
                    self.pids[ev["rank"]] = ev["pid"]
                elif ev.get("ev") == "exit":
                    self.codes[ev["rank"]] = ev["code"]
                    self.hwm[ev["rank"]] = ev.get("hwm")
                self._cond.notify_all()
        with self._cond:
            self._done = True
            for r in range(self.world_size):  # the supervisor is gone: so are the ranks
                self.codes.setdefault(r, -int(signal.SIGKILL))
            self._cond.notify_all()

    def poll(self) -> list[int | None]:
        """Each rank's exit status so far (None while it runs; < 0: killed by that signal)."""
        with self._cond:
            return [self.codes.get(r) for r in range(self.world_size)]

    def alive(self) -> bool:
        return not self._done and all(c is None for c in self.poll())

    def wait_pids(self, timeout_s: float = 10.0) -> dict[int, int]:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self.pids) < self.world_size and not self._done and time.monotonic() < deadline:
                self._cond.wait(0.05)
            return dict(self.pids)

    # -- commands --------------------------------------------------------------------------------------
    def _command(self, **cmd) -> bool:
        try:
            self.sup.stdin.write((json.dumps(cmd) + "\n").encode())
            self.sup.stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    def signal(self, sig: int) -> None:
        """Send ``sig`` to every rank still running (through the supervisor, which knows which are)."""
        self._command(cmd="signal", sig=int(sig))

    def send(self, line: str) -> bool:
        """Write one line to every live rank's stdin; False when a rank's pipe is closed."""
        data = (line.rstrip("\n") + "\n").encode()
        ok = True
        for r, fd in self._stdin.items():
            if self.codes.get(r) is not None:
                ok = False
                continue
            try:
                os.write(fd, data)
            except OSError:
                ok = False
        return ok

    def stderr_tail(self, rank: int) -> str:
        return "".join(self.pumps[rank][1].tail).strip()

    def kill(self) -> None:
        """End every rank and everything they started, and wait for it (idempotent)."""
        if not self._command(cmd="kill"):
            pass
        try:
            self.sup.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            self.sup.wait(timeout=20)
        except subprocess.TimeoutExpired:  # should not happen: fall back to what we know
            for pid in self.pids.values():
                try:
                    os.killpg(pid, signal.SIGKILL)
                except OSError:
                    pass
            self.sup.kill()
            self.sup.wait()
        for fd in self._stdin.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self._stdin.clear()
        self._reader.join(timeout=5)
        for pumps in self.pumps.values():
            for p in pumps:
                p.thread.join(timeout=2)
