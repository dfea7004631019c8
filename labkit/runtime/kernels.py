"""Chapter kernels forked from a kernel template: how ``labkit run`` starts the kernel of each chapter.

Why: a fresh Jupyter kernel for a chapter pays, before its first cell has done anything, the interpreter and
ipykernel's start (~2 s), the chapter's imports (torch, pandas, plotly, labkit: 6-9 s on a laptop core) and its
own rank template (zygote.py: ~10 s of CPU for torch and ``torch._dynamo``). Thirteen chapters paid that
thirteen times. Here one process per ``labkit run`` (the *kernel template*) imports all of it once, and each
chapter's kernel is forked from it, already imported, with a rank template of its own forked from it too.

What a forked kernel is, compared with the kernel ``python -m ipykernel_launcher -f CONN`` would start:

* the same command line, environment (Jupyter's, with ``JPY_PARENT_PID``), working directory (the chapter's
  folder, first on ``sys.path`` as ``python -m`` puts it), standard streams and session of its own; random
  generators reseeded and import caches cleared (reset.py), as for a forked rank;
* modules already imported: :func:`kernel_preload` lists them. None of them may look at the IPython shell
  when imported (plotly's default renderer, ipywidgets' comm target, ``tqdm.auto`` choose at import what a
  kernel shows): :data:`SHELL_SENSITIVE` are checked absent before the template says it is ready;
* its rank template is its own child (``zygote.Zygote.fork_here``), forked before the kernel starts any
  thread, and ends with the kernel as a started one would.

It is used only where the kernel would be this interpreter's own ipykernel (the ``python3`` kernel of this
environment) under the same import-time environment; any other kernel, or ``LABKIT_KERNEL_START=spawn``,
starts as Jupyter starts it. The template ends when ``labkit run`` does (EOF on its stdin).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys

from jupyter_client.manager import AsyncKernelManager
from jupyter_client.provisioning import LocalProvisioner

from labkit.runtime import zygote

#: imported by a kernel at import time only (they look at the running IPython shell, absent in the template)
SHELL_SENSITIVE = ("ipywidgets", "plotly.io._renderers", "tqdm.auto", "tqdm.autonotebook", "matplotlib_inline")

_TEMPLATE: zygote.Zygote | None = None
_TEMPLATE_ENV: dict | None = None


def kernel_preload() -> tuple[str, ...]:
    """What the kernel template imports: what ranks import (zygote.PRELOAD), ipykernel, the libraries the
    chapters use and every chapter module (found on disk, so the caller need not import them)."""
    import pkgutil

    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "chapters")
    chapters = sorted(f"labkit.chapters.{m.name}" for m in pkgutil.iter_modules([folder]))
    return (*zygote.PRELOAD, "ipykernel.kernelapp", "ipykernel.ipkernel", "pandas", "plotly.graph_objects",
            "plotly.express", "plotly.io._base_renderers", "plotly.io._html", "plotly.io._json",
            "nbformat.v4",  # what plotly's renderers import (2 s: jsonschema), without the renderers themselves
            "labkit.chapters", *chapters)


def check_preloaded() -> None:
    """In the template, after the preload: raise RuntimeError if a module that must be imported under the
    kernel's shell (:data:`SHELL_SENSITIVE`) was imported."""
    import pandas as pd
    import plotly.express as px

    px.bar(pd.DataFrame({"x": [0], "y": [1]}), x="x", y="y")  # plotly loads its figure classes at first use
    early = [m for m in SHELL_SENSITIVE if m in sys.modules]
    if early:
        raise RuntimeError(f"the kernel preload (or its first figure) imported {', '.join(early)}, which must "
                           "be imported by a kernel")


def become_kernel(req: dict, fds: list[int]) -> None:
    """In a freshly forked child of the kernel template: become the kernel ``req["argv"]`` would start
    (``python -m ipykernel_launcher ...``) with ``req["env"]`` in ``req["cwd"]``; ``fds``: its stdin, stdout
    and stderr. Never returns."""
    import atexit
    import importlib
    import runpy
    import traceback

    code = 1
    try:
        from labkit.runtime import supervisor as sv
        from labkit.runtime.launcher import _rank_env
        from labkit.runtime.safepath import shipped_sys_path

        os.setsid()  # as jupyter starts a kernel: its own session, so an interrupt reaches its group only
        sv.set_process_name(os.path.basename(sys.executable))  # in ps, as a started kernel: not the template's
        sv.prctl(sv.PR_SET_PDEATHSIG, signal.SIGTERM)  # the template ends only after labkit run has
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        for target, fd in enumerate(fds[:3]):
            os.dup2(fd, target)
        os.closerange(3, 1 << 16)  # the template's socket, other kernels' streams: a fresh kernel has none
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.path.insert(0, os.getcwd())  # what ``python -m`` puts first
        sys.argv = [req["argv"][0], *req["argv"][3:]]
        sys.path_importer_cache.clear()
        importlib.invalidate_caches()
        sys.modules["labkit.runtime.reset"].reseed_as_fresh_process()
        if zygote.forking_enabled():  # this kernel's own rank template, forked while it runs one thread
            zygote.adopt(zygote.Zygote.fork_here(zygote._key(_rank_env(1), shipped_sys_path())))
        runpy.run_module("ipykernel_launcher", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:  # noqa: BLE001 - the kernel's stderr is where a fresh kernel would say it
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()  # a kernel's exit handlers (its rank template's end, IPython's history)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class ForkedKernel(zygote.ProcessView):
    """A kernel the template forked, as jupyter_client's provisioner sees it (the template's child, not ours:
    reaped there, so running means "exists and is not a zombie")."""

    def __init__(self, pid: int):
        super().__init__(pid)
        self._signal = 0

    def poll(self) -> int | None:
        from labkit.runtime.supervisor import process_running

        if self.returncode is None and not process_running(self.pid):
            self.returncode = -self._signal  # its status went to the template; a signal we sent, else 0
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if signum in (signal.SIGKILL, signal.SIGTERM) and self.poll() is None:
            self._signal = signum
        super().send_signal(signum)


def _is_own_ipykernel(cmd: list[str]) -> bool:
    exe = cmd[0] if os.path.isabs(cmd[0]) else shutil.which(cmd[0]) or cmd[0]
    return (len(cmd) >= 3 and cmd[1:3] == ["-m", "ipykernel_launcher"]
            and os.path.realpath(exe) == os.path.realpath(sys.executable))


class ForkingProvisioner(LocalProvisioner):
    """jupyter_client's local provisioner, whose kernel is forked from the kernel template when one is
    running and the kernel is one it can be (module docstring); otherwise exactly the local provisioner."""

    async def launch_kernel(self, cmd: list[str], **kwargs):
        template, env = _TEMPLATE, dict(kwargs.get("env") or os.environ)
        if (template is None or not _is_own_ipykernel(cmd)
                or zygote.import_time_env(env) != zygote.import_time_env(_TEMPLATE_ENV or {})):
            return await super().launch_kernel(cmd, **kwargs)
        env["JPY_PARENT_PID"] = str(os.getpid())
        cwd = os.path.realpath(str(kwargs.get("cwd") or os.getcwd()))
        devnull = os.open(os.devnull, os.O_RDONLY)
        try:
            pid = template.request({"kernel": {"argv": cmd, "env": env, "cwd": cwd}}, [devnull, 1, 2])
        except RuntimeError as e:
            print(f"labkit: this chapter's kernel starts fresh ({e})", file=sys.stderr)
            return await super().launch_kernel(cmd, **kwargs)
        finally:
            os.close(devnull)
        self.process = ForkedKernel(pid)
        self.pid = self.pgid = pid  # the kernel leads its own session and process group
        self.cwd = cwd
        return self.connection_info


class ForkingKernelManager(AsyncKernelManager):
    """The kernel manager papermill is given (``kernel_manager_class``) inside :func:`kernel_template`."""

    async def _async_pre_start_kernel(self, **kw):
        if self.provisioner is None:
            import uuid

            self.kernel_id = self.kernel_id or kw.pop("kernel_id", str(uuid.uuid4()))
            self.provisioner = ForkingProvisioner(kernel_id=self.kernel_id, kernel_spec=self.kernel_spec,
                                                  parent=self)
        return await super()._async_pre_start_kernel(**kw)


def forking_kernels() -> bool:
    """Whether chapters' kernels are forked: not under ``LABKIT_KERNEL_START=spawn`` (nor where ranks are
    not forked either, zygote.forking_enabled)."""
    return os.environ.get("LABKIT_KERNEL_START", "fork") != "spawn" and zygote.forking_enabled()


@contextlib.contextmanager
def kernel_template():
    """Run a kernel template while the body executes notebooks; yields the ``kernel_manager_class`` to give
    papermill (None when kernels start fresh: :func:`forking_kernels` is False, or the template did not
    start, which is said on stderr). Starting takes ~15 s of CPU once."""
    global _TEMPLATE, _TEMPLATE_ENV
    if not forking_kernels():
        yield None
        return
    env = os.environ.copy()
    try:
        template = zygote.Zygote.start(env, [], key="kernels", preload=kernel_preload(), kernels=True)
    except (OSError, RuntimeError) as e:
        print(f"labkit: chapters start in fresh kernels ({e})", file=sys.stderr)
        yield None
        return
    _TEMPLATE, _TEMPLATE_ENV = template, env
    try:
        yield ForkingKernelManager
    finally:
        _TEMPLATE = _TEMPLATE_ENV = None
        template.close()
