"""The rank template ("zygote"): one process per caller that has imported what every rank imports, and forks
each launch's supervisor (supervisor.py), which forks the ranks.

Why: a fresh rank interpreter pays ``import torch`` (about 4 s of CPU on a laptop core) and, at its first
``torch.optim`` optimizer, ``import torch._dynamo`` (about 6 s more: sympy and 800 modules). Eight ranks on two
cores paid that 40 s of wall time before any of them trained. Forked from a template that paid it once, a rank
starts in milliseconds, and its pages are shared with the template until written.

What the template is and is not:

* started once per caller process, at the first launch (:func:`get`), with the ranks' environment and the
  caller's ``sys.path`` without the working directory (``python -P``, safepath.py), in a neutral folder; it
  imports :data:`PRELOAD` and then waits. A caller whose ``sys.path`` or environment changed gets a new one
  (the old one is ended);
* it never runs user code: each request (a spec file in a launch's private folder and the launch's pipes,
  passed over a socketpair only the caller holds) forks a child that becomes that launch's supervisor — in its
  own session, in the launch's folder, as a child subreaper — and forks the ranks from itself. From there on
  the launch is exactly as supervisor.py describes: the caller talks to the supervisor over its pipes;
* it ends when the caller does (EOF on its stdin pipe, which only the caller holds; a SIGKILLed caller closes
  it too) or on :func:`close`; supervisors it started then see their parent change, or their control pipe
  close, and end their ranks.

If the template cannot start (an import fails, the platform has no ``fork``), launches start their supervisor
directly as before (:func:`get` returns None); ``LABKIT_RANK_START=spawn`` asks for fresh interpreters.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

#: imported once by the template; every forked rank starts with them
PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.optim", "cloudpickle", "numpy",
           "labkit.runtime.worker", "labkit.runtime.reset")
START_TIMEOUT_S = 300.0  # preloading takes ~10 s of CPU; a loaded 2-core machine can take several times that

_LOCK = threading.Lock()
_CURRENT: Zygote | None = None
_FAILED: set[str] = set()
_PRESTART = True  # False in a template: importing labkit.chapters there must not start a thread


class Zygote:
    """The caller's side of one template process (module docstring). Internal: launches use :func:`get`."""

    def __init__(self, key: str, proc, sock: socket.socket):
        self.key, self.owner, self.proc, self.sock = key, os.getpid(), proc, sock
        self._lock = threading.Lock()

    @classmethod
    def start(cls, env: dict, sys_path: list[str], key: str, preload: tuple[str, ...] = PRELOAD,
              kernels: bool = False) -> Zygote:
        """Start a template process that imports ``preload`` (blocking until it has); ``kernels``: it also
        forks notebook kernels (kernels.py). Raises RuntimeError when it did not start."""
        from labkit.runtime.safepath import boot_argv

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cfg = json.dumps({"sys_path": sys_path, "preload": list(preload), "kernels": kernels})
        try:
            proc = subprocess.Popen(boot_argv("labkit.runtime.zygote", "main", [str(theirs.fileno()), cfg]),
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=None,
                                    cwd=os.path.realpath(os.sep), env=env, pass_fds=[theirs.fileno()],
                                    start_new_session=True)
        finally:
            theirs.close()
        z = cls(key, proc, ours)
        ready, _, _ = select.select([ours], [], [], START_TIMEOUT_S)
        reply = ours.recv(65536) if ready else b""
        if reply != b"ready":
            z.close()
            raise RuntimeError(f"the template did not start: {reply.decode(errors='replace') or 'no reply'}")
        return z

    @classmethod
    def fork_here(cls, key: str) -> Zygote:
        """Fork a template from this process, which has imported :data:`PRELOAD` and runs no other thread
        (a kernel forked from a kernel template, kernels.py, before its kernel starts): the template for
        this process's ranks, ready at once. ``key``: what :func:`get` will ask for."""
        if threading.active_count() != 1:
            raise RuntimeError("a rank template can only be forked from a single-threaded process")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        r, w = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                ours.close()
                os.close(w)
                os.dup2(r, 0)
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 1)  # as a started template: stdout to nowhere, stderr the caller's
                keep = sorted({0, 1, 2, theirs.fileno()})
                for lo, hi in zip([-1, *keep], [*keep, 1 << 16]):  # nothing else of the caller's stays open
                    if lo + 1 < hi:  # os.closerange(n, n) is not empty on Linux: close_range(n, n - 1) is all
                        os.closerange(lo + 1, hi)
                os.setsid()
                os.chdir(os.path.realpath(os.sep))
                code = _serve(theirs, kernels=False)
            except BaseException:  # noqa: BLE001 - said on stderr; the caller sees a dead template
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(code)
        os.close(r)
        theirs.close()
        return cls(key, _Child(pid, os.fdopen(w, "wb")), ours)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork_supervisor(self, spec_path: str, fds: list[int]) -> int:
        """Fork a supervisor for the launch whose spec is ``spec_path``; ``fds``: its control stdin (read end),
        its control stdout (write end), then the ranks' pipe ends in the order the spec lists them. Returns the
        supervisor's pid. Raises RuntimeError when the template is gone."""
        return self.request({"spec": spec_path}, fds)

    def request(self, req: dict, fds: list[int]) -> int:
        """Send one request (a launch's spec, or a kernel for a kernel template) with ``fds``; the pid of the
        child the template forked for it. Raises RuntimeError when the template is gone or refused."""
        with self._lock:
            try:
                socket.send_fds(self.sock, [json.dumps(req).encode()], fds)
                ready, _, _ = select.select([self.sock], [], [], 60.0)
                reply = json.loads(self.sock.recv(65536) or b"{}") if ready else {}
            except (OSError, ValueError) as e:
                raise RuntimeError(f"the template is gone ({e})") from None
        if "pid" not in reply:
            raise RuntimeError(f"the template refused the request: {reply.get('error', 'no reply')}")
        return int(reply["pid"])

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        if os.getpid() != self.owner:
            return  # a forked copy of the caller: the template is the caller's, not ours
        try:
            self.proc.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ProcessView:
    """The part of ``subprocess.Popen`` that :class:`Zygote` and jupyter_client use, for a process this one
    did not start from a command (a subclass says how to :meth:`poll` it)."""

    stdin = stdout = stderr = None

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"process {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Child(ProcessView):
    """A template forked by :meth:`Zygote.fork_here`: a child of this process, reaped here."""

    def __init__(self, pid: int, stdin):
        super().__init__(pid)
        self.stdin = stdin

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                done, status = self.pid, 0
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


#: environment variables read when torch and its libraries load (a template made under other values is not
#: reused); every other variable is read at run time, and a forked rank gets the launch's environment
IMPORT_TIME_ENV = ("PYTHON", "TORCH", "OMP_", "KMP_", "MKL_", "OPENBLAS", "GOMP", "LD_", "CUDA", "NCCL",
                   "NVIDIA", "HIP", "ROCM", "LABKIT_RANK_START")


def import_time_env(env: dict) -> list[tuple[str, str]]:
    """The variables of ``env`` that torch and its libraries read when imported (:data:`IMPORT_TIME_ENV`),
    sorted; ``OMP_NUM_THREADS`` left out: each rank (and kernel) sets its threads itself."""
    return sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k != "OMP_NUM_THREADS")


def _key(env: dict, sys_path: list[str]) -> str:
    return json.dumps([sys.executable, sys_path, import_time_env(env)])


def forking_enabled() -> bool:
    """Whether ranks are forked (from the template, else from their supervisor): not under
    ``LABKIT_RANK_START=spawn``, nor where the platform has no ``fork``."""
    return os.environ.get("LABKIT_RANK_START", "fork") != "spawn" and hasattr(os, "fork")


def get(env: dict, sys_path: list[str]) -> Zygote | None:
    """The template for ranks with this environment and ``sys_path`` (started now, blocking, when there is
    none), or None when ranks must start without one (it failed to start for this key, or
    ``LABKIT_RANK_START=spawn``)."""
    global _CURRENT
    if not forking_enabled():
        return None
    key = _key(env, sys_path)
    with _LOCK:
        z = _CURRENT
        if z is not None and (z.owner != os.getpid() or z.key != key or not z.alive()):
            if z.owner == os.getpid():
                z.close()
            _CURRENT = z = None
        if z is None and key not in _FAILED:
            try:
                if os.environ.get("LABKIT_TEMPLATE_LOG"):  # which callers start templates, and why (tests)
                    with open(os.environ["LABKIT_TEMPLATE_LOG"], "a") as f:
                        f.write(json.dumps({"pid": os.getpid(), "t": time.time(), "key": key,
                                            "argv": sys.argv[:3]}) + "\n")
                z = _CURRENT = Zygote.start(env, sys_path, key)
            except (OSError, RuntimeError) as e:
                _FAILED.add(key)
                print(f"labkit: ranks start as fresh interpreters ({e})", file=sys.stderr)
        return z


def prestart() -> None:
    """Start the template in the background now (chapters call this on import in a Jupyter kernel, so that the
    import of torch it pays runs beside the kernel's own imports and the first launch finds it ready). Nothing
    outside a kernel, in a template, or when ranks start without one."""
    if not forking_enabled() or not _PRESTART or "ipykernel" not in sys.modules:
        return  # a script, the CLI, a template: a launch starts the template when it needs one

    def start() -> None:
        from labkit.runtime.launcher import _rank_env
        from labkit.runtime.safepath import shipped_sys_path

        get(_rank_env(1), shipped_sys_path())

    threading.Thread(target=start, daemon=True, name="labkit-template-start").start()


def settle() -> None:
    """Wait until a template start in progress (:func:`prestart`) has finished: a measurement of what the
    cores can do (a matmul peak) must not run beside its import of torch."""
    with _LOCK:
        pass


def template_pid() -> int | None:
    """The pid of this process's rank template, None when it has none (tests leave it out of "no process
    outlives a launch": it outlives every launch by design, and holds no rank)."""
    z = _CURRENT
    return z.pid if z is not None and z.owner == os.getpid() and z.alive() else None


def close() -> None:
    """End the template (launches still running keep their supervisor and ranks until they end)."""
    global _CURRENT
    with _LOCK:
        z, _CURRENT = _CURRENT, None
    if z is not None:
        z.close()


def adopt(z: Zygote) -> None:
    """Make ``z`` (:meth:`Zygote.fork_here`) this process's template: :func:`get` returns it while the key
    matches."""
    global _CURRENT
    with _LOCK:
        _CURRENT = z


atexit.register(close)


# -- the template process ----------------------------------------------------------------------------------
def _become_supervisor(req: dict, fds: list[int]) -> None:
    """In a freshly forked child of the template: run one launch's supervisor; never returns."""
    code = 1
    try:
        from labkit.runtime import supervisor as sv

        os.setsid()
        sv.set_process_name("labkit-launch")
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        ctl_in, ctl_out, *rank_fds = fds
        os.dup2(ctl_in, 0)
        os.dup2(ctl_out, 1)
        for fd in (ctl_in, ctl_out):
            os.close(fd)
        with open(req["spec"]) as f:
            spec = json.load(f)
        it = iter(rank_fds)
        for rank in spec["ranks"]:  # the caller's descriptor numbers -> the ones received here, same order
            for k in ("stdout", "stderr", "stdin"):
                if rank.get(k) is not None:
                    rank[k] = next(it)
        spec["parent_pid"] = os.getppid()  # the template; the caller is spec["caller_pid"]
        os.chdir(spec["run_dir"])
        sv.prctl(sv.PR_SET_CHILD_SUBREAPER, 1)
        sv._Supervisor(spec).serve()
        code = 0
    except BaseException:  # noqa: BLE001 - said on stderr (the caller's), then the launch fails as a dead supervisor
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def main(argv: list[str]) -> int:
    """``boot_argv("labkit.runtime.zygote", "main", [SOCKET_FD, CONFIG_JSON])``."""
    global _PRESTART
    import importlib
    import warnings

    _PRESTART = False
    sock = socket.socket(fileno=int(argv[0]))
    cfg = json.loads(argv[1])
    for p in reversed(cfg["sys_path"]):
        if p not in sys.path:
            sys.path.insert(0, p)
    try:
        warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)  # Python 3.12+
        for name in cfg["preload"]:
            importlib.import_module(name)
        if cfg.get("kernels"):
            from labkit.runtime import kernels

            kernels.check_preloaded()
    except BaseException as e:  # noqa: BLE001 - told to the caller, which starts ranks without us
        sock.send(f"{type(e).__name__}: {e}".encode()[:60000])
        return 1
    sock.send(b"ready")
    return _serve(sock, kernels=bool(cfg.get("kernels")))


def _serve(sock: socket.socket, kernels: bool) -> int:
    """The template's loop: fork a launch's supervisor (or, with ``kernels``, a notebook kernel) for each
    request on ``sock``, until the caller is gone (EOF on stdin or on ``sock``)."""
    from labkit.runtime.supervisor import set_process_name

    set_process_name("labkit-kernels" if kernels else "labkit-template")
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:  # reap supervisors (kernels) that ended
                pass
        except ChildProcessError:
            pass
        ready, _, _ = select.select([sock, 0], [], [], 1.0)
        if 0 in ready and not os.read(0, 4096):
            return 0  # the caller is gone (or closed us)
        if sock not in ready:
            continue
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 256)
        except OSError:
            return 0
        if not msg:
            return 0
        try:
            req = json.loads(msg)
            if ("kernel" in req) != kernels:
                raise ValueError
        except ValueError:
            for fd in fds:
                os.close(fd)
            sock.send(b'{"error": "unreadable request"}')
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            if kernels:
                from labkit.runtime.kernels import become_kernel

                become_kernel(req["kernel"], fds)
            _become_supervisor(req, fds)
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())
