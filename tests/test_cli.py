"""The labkit CLI: bad input is one line on stderr and exit 2; doctor probes collectives for real."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.cli import main

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True, text=True, env=env,
                          timeout=120)


@pytest.mark.parametrize("args, needle", [
    (["doctor", "--world-size", "0"], "--world-size=0"),
    (["run", "--chapters", "99"], "chapter '99' not found"),
    (["run", "-p", "world_size"], "name=value"),
    (["run", "--cell-timeout", "-1"], "--cell-timeout"),
    (["doctor", "--bogus"], "unrecognized arguments"),
    (["doctor", "--timeout", "-1"], "--timeout=-1.0"),
    (["run", "--chapters", ",,"], "names no chapter"),
    (["run", "--chapters", "00", "-p", "wrld_size=4"], "wrld_size declared by none"),
    (["run", "--chapters", "00", "--out", "/proc/forbidden/x"], "No such file or directory"),
    (["nosuchcommand"], "invalid choice"),
    (["plan", "--validate", "--gpus", "8"], "--gpus does not apply to --validate"),
    (["run", "--chapters", "00", "-p", "work_ms=-5"], "chapter 00: work_ms=-5 must be"),  # the chapter's own check,
    (["run", "--chapters", "09", "-p", "world_size=3"], "chapter 09 needs an even world_size"),  # before a kernel
])
def test_bad_input_is_one_line_and_exit_2(args, needle, capsys):
    with pytest.raises(SystemExit) as info:
        rc = main(args)
        raise SystemExit(rc)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1, err


def test_no_command_prints_help_and_exit_2():
    proc = run_cli()
    assert proc.returncode == 2 and "COMMAND" in proc.stdout


def test_doctor_probes_collectives():
    proc = run_cli("doctor", "--world-size", "2")
    assert proc.returncode == 0, proc.stderr
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv"):
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith(op)]
        assert line and line[0].split()[1:] == ["ok", "ok"], proc.stdout
    assert "torch" in proc.stdout and "backends" in proc.stdout


def test_launch_failure_is_one_line_exit_1():
    proc = run_cli("doctor", "--timeout", "0.001")  # shorter than any start-up
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1 and "had not reached the rank function" in proc.stderr


def test_closed_pipe_is_quiet():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.Popen([sys.executable, "-m", "labkit", "memory", "--model", "llama-3-70b", "--json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    p.stdout.read(10)
    p.stdout.close()  # like `| head -c 10`
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 0 and "Traceback" not in err, err


@pytest.mark.parametrize("script, bad", [
    ("launch_overhead", "--world-size=0"), ("planner_speed", "--gpus=0"), ("dp_vs_torch", "--world-size=0"),
    ("pp_vs_torch", "--pp=0"), ("tp_vs_dtensor", "--model=nope"), ("collectives_overhead", "--repeats=0"),
])
def test_benchmark_bad_argument_is_one_line_exit_2(script, bad):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / f"{script}.py"), bad], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith(f"{script}: "), proc.stderr


def test_run_main_maps_user_errors_to_exit_codes(capsys):
    from labkit.cli import run_main
    from labkit.runtime.launcher import LaunchTimeout

    def timeout():
        raise LaunchTimeout("launch timed out after 1 s\nstacks...", rank=0, world_size=2, stacks={}, elapsed_s=1.0)

    assert run_main("x", lambda: None) == 0 and run_main("x", lambda: 1) == 1
    assert run_main("x", lambda: int("nope")) == 2
    assert run_main("x", timeout) == 1
    assert capsys.readouterr().err.splitlines()[-1] == "x: error: launch timed out after 1 s"
    with pytest.raises(KeyError):
        run_main("x", lambda: {}["bug"])  # a bug keeps its traceback


def test_run_unknown_kernel_is_one_line_exit_2():
    proc = run_cli("run", "--chapters", "00", "--kernel", "nope")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        proc.stderr.strip()] and "kernel='nope' is not an installed Jupyter kernel" in proc.stderr


@pytest.mark.parametrize("args, needle", [
    (["memory", "--params", "1e308"], "labkit memory: error:"),  # OverflowError inside the estimate
    (["memory", "--model", "llama-3-8b", "--seq", "9" * 320], "labkit memory: error:"),
    (["plan", "--model", "llama-3-70b", "--gpus", str(10**18), "--global-batch", "1024"], "out of range: valid 1.."),
    (["run", "-p", "x=[1,"], "parameter x: value '[1,' is not valid YAML"),
    (["run", "-p", "world_size=1000"], "the largest world_size that fits is"),
])
def test_issue_17_inputs_are_one_line_exit_2_within_a_second(args, needle, capsys):
    import time

    t0 = time.perf_counter()
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert time.perf_counter() - t0 < 1.0


def test_run_main_one_line_for_every_user_error(capsys):
    import yaml

    from labkit.cli import run_main

    def yaml_error():
        yaml.safe_load("[1,")

    for fn in (lambda: float("1e308") * 10**400, lambda: sum(5), yaml_error, lambda: 1 / 0):
        assert run_main("x", fn) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 4 and all(ln.startswith("x: error: ") for ln in lines), lines
