"""Chapter kernels forked from a kernel template (runtime/kernels.py, behind ``labkit run``): a forked kernel
looks, from inside, like the kernel Jupyter would have started; its rank template is its own child; nothing
outlives the template; other kernels start as Jupyter starts them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import nbformat
import psutil
import pytest

from labkit.notebooks import run_notebook
from labkit.runtime import kernels, zygote

FACTS = """
import json, os, random, sys
import plotly.io as pio, psutil, torch, tqdm.auto
from comm import get_comm_manager
import ipywidgets  # registers its comm target with the running kernel, at import
from labkit.runtime import zygote
from labkit.runtime.launcher import _rank_env
from labkit.runtime.safepath import shipped_sys_path

z = zygote.get(_rank_env(1), shipped_sys_path())
facts = {
    "cwd": os.getcwd(), "path0": sys.path[0], "renderer": pio.renderers.default,
    "tqdm": tqdm.auto.tqdm.__module__, "shell": type(get_ipython()).__name__, "argv1": sys.argv[1],
    "own_session": os.getsid(0) == os.getpid(), "jpy_parent": "JPY_PARENT_PID" in os.environ,
    "widget_target": "jupyter.widget" in get_comm_manager().targets,
    "template_is_our_child": z is not None and z.pid in [c.pid for c in psutil.Process().children()],
    "seed": torch.initial_seed(), "rand": random.random(),
}
json.dump(facts, open(OUT, "w"))
"""


def _facts_notebook(folder, out):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"OUT = {str(out)!r}"), nbformat.v4.new_code_cell(FACTS)]
    nb.cells[0].metadata["tags"] = ["parameters"]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = folder / "facts.ipynb"
    nbformat.write(nb, str(path))
    return path


def _run(path, out, manager):
    row = run_notebook(path, path.parent / "executed.ipynb", cell_timeout_s=240, kernel_manager_class=manager)
    assert row["status"] == "ok", row
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_forked_kernel_is_like_a_fresh_one_and_leaves_nothing(tmp_path):
    before = {p.pid for p in psutil.Process().children(recursive=True)} - {zygote.template_pid()}
    (tmp_path / "nb").mkdir()
    out = tmp_path / "facts.json"
    path = _facts_notebook(tmp_path / "nb", out)
    fresh = _run(path, out, None)
    with kernels.kernel_template() as manager:
        assert manager is kernels.ForkingKernelManager
        template = kernels._TEMPLATE.pid
        forked = [_run(path, out, manager) for _ in range(2)]
        assert psutil.Process(template).is_running()
    assert not psutil.pid_exists(template) or psutil.Process(template).status() == psutil.STATUS_ZOMBIE
    same = {k: v for k, v in fresh.items() if k not in ("seed", "rand")}
    for f in forked:
        assert {k: v for k, v in f.items() if k not in ("seed", "rand")} == same, (f, fresh)
    assert fresh["cwd"] == str((tmp_path / "nb").resolve())  # and sys.path[0] as a fresh one has it
    assert fresh["template_is_our_child"] and fresh["widget_target"] and fresh["own_session"]
    # each forked kernel draws its own random numbers, as fresh interpreters do
    assert forked[0]["seed"] != forked[1]["seed"] and forked[0]["rand"] != forked[1]["rand"]
    left = {p.pid for p in psutil.Process().children(recursive=True)
            if p.status() != psutil.STATUS_ZOMBIE} - {zygote.template_pid()} - before
    assert not left, [psutil.Process(p).cmdline()[:3] for p in left]


def test_only_this_environments_ipykernel_is_forked(monkeypatch):
    assert kernels._is_own_ipykernel([sys.executable, "-m", "ipykernel_launcher", "-f", "c.json"])
    assert not kernels._is_own_ipykernel(["/usr/bin/python3-other", "-m", "ipykernel_launcher", "-f", "c.json"])
    assert not kernels._is_own_ipykernel([sys.executable, "-m", "some_other_kernel", "-f", "c.json"])
    monkeypatch.setenv("LABKIT_KERNEL_START", "spawn")
    assert not kernels.forking_kernels()
    with kernels.kernel_template() as manager:
        assert manager is None


def test_the_kernel_preload_leaves_shell_dependent_modules_to_the_kernel():
    """plotly's default renderer, ipywidgets' comm target and tqdm.auto's choice are made at import from the
    running shell: the template (no shell) must not import them, nor may drawing a first figure."""
    code = textwrap.dedent(f"""
        import importlib, sys
        for name in {list(kernels.kernel_preload())!r}:
            importlib.import_module(name)
        from labkit.runtime import kernels
        kernels.check_preloaded()
        print([m for m in kernels.SHELL_SENSITIVE if m in sys.modules])
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         cwd=os.path.realpath(os.sep))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "[]"


def test_a_template_forked_in_place_serves_launches(tmp_path):
    """Zygote.fork_here (what a forked kernel does before it starts): launches use it, none starts another;
    it keeps the caller's stdio (an empty os.closerange(n, n) once closed every descriptor)."""
    log = tmp_path / "starts.jsonl"
    code = textwrap.dedent("""
        import sys
        from labkit import launch
        from labkit.runtime import zygote
        from labkit.runtime.launcher import _rank_env
        from labkit.runtime.safepath import shipped_sys_path
        import labkit.runtime.worker, labkit.runtime.reset, torch.optim
        z = zygote.Zygote.fork_here(zygote._key(_rank_env(1), shipped_sys_path()))
        zygote.adopt(z)
        import torch.distributed as dist
        def add(ctx):
            t = torch.tensor([float(ctx.rank + 1)])
            dist.all_reduce(t)
            return t.item()
        import torch
        print(list(launch(add, 2, timeout_s=120)), z.alive(), zygote.template_pid() == z.pid)
    """)
    env = dict(os.environ, LABKIT_TEMPLATE_LOG=str(log))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                         cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == "[3.0, 3.0] True True"
    assert not log.exists() or not log.read_text().strip(), log.read_text()


@pytest.mark.slow
def test_ctrl_c_to_labkit_run_ends_the_template_its_kernels_and_their_ranks(tmp_path):
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "labkit", "run", "--chapters", "06", "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline, seen = time.monotonic() + 180, []
    while time.monotonic() < deadline and proc.poll() is None:  # until the forked kernel has launched ranks
        seen = psutil.Process(proc.pid).children(recursive=True)
        if any(p.name().startswith("labkit-rank") for p in seen if p.is_running()):
            break
        time.sleep(0.5)
    names = {p.name() for p in seen}
    assert {"labkit-kernels", "labkit-template"} <= names, names
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 130 and "interrupted" in out, out[-2000:]
    time.sleep(3)
    left = [(p.pid, p.name()) for p in seen if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, left
