"""Many nodes on one machine: two `torchrun --nnodes 2` "nodes" on loopback, started by the Slurm example's
per-node script, with node 1's timeline clock skewed by LABKIT_TEST_CLOCK_SKEW_NS as if it were another host.

Checks the results (ranks, nodes, summed counts), that the worker's ping-pong estimate finds the skew and the
merged timeline removes it, and that no process outlives the test. Also checks, without running anything, the
steps scaling.sbatch would submit (a fake srun records them).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labkit.experiments import scaling
from labkit.runtime.launcher import load_results

ROOT = Path(__file__).resolve().parent.parent
SLURM = ROOT / "examples" / "slurm"
SKEW_NS = 3_000_000_000  # node 1's clock runs 3 s ahead of node 0's
HARD_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_members(sids: set[int]) -> list[int]:
    """Live processes (not zombies) whose session id is one of ``sids`` (Linux /proc)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if os.getsid(int(d.name)) in sids and (d / "stat").read_text().split(") ")[-1][0] != "Z":
                out.append(int(d.name))
        except (ProcessLookupError, PermissionError, FileNotFoundError, OSError):
            pass
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="process sessions and /proc are Linux")
def test_two_nodes_on_loopback_results_and_clock_alignment(tmp_path):
    out = tmp_path / "run"
    port = _free_port()
    kwargs = {"experiment": "matmul", "strong_total": 4, "weak_per_rank": 2, "size": 64, "warmup": 1,
              "repeats": 3}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LABKIT_TEST_"))}
    base.update({"PYTHON": sys.executable, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                 "NNODES": "2", "NPROC_PER_NODE": "1", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
                 "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    procs, logs = [], []
    for node in (0, 1):
        env = dict(base, NODE_RANK=str(node))
        if node == 1:
            env["LABKIT_TEST_CLOCK_SKEW_NS"] = str(SKEW_NS)
        log = open(tmp_path / f"node{node}.log", "w")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(subprocess.Popen(["bash", str(SLURM / "node.sh"), str(out),
                                       "labkit.experiments.scaling:torchrun_point", json.dumps(kwargs)],
                                      cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    sids = {p.pid for p in procs}
    deadline = time.monotonic() + HARD_TIMEOUT_S
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):  # one node failed: do not wait for the other
                time.sleep(2)
                break
            time.sleep(0.2)
    finally:
        timed_out = any(p.poll() is None for p in procs)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait(timeout=30)
        for log in logs:
            log.close()
        stray = _session_members(sids)
        for pid in stray:  # never leave anything behind, even when the assertion below fails
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = "\n".join(f"--- node {i} ---\n" + (tmp_path / f"node{i}.log").read_text()[-3000:] for i in (0, 1))
    assert not timed_out, f"two-node run exceeded {HARD_TIMEOUT_S} s\n{text}"
    assert [p.returncode for p in procs] == [0, 0], text
    assert not stray, f"processes left behind: {stray}"

    res = load_results(out)
    meta = json.loads((out / "meta.json").read_text())
    assert res.world_size == 2 and meta["n_nodes"] == 2 and res.backend == "gloo"
    assert [r["rank"] for r in res] == [0, 1] and [r["node_rank"] for r in res] == [0, 1]
    rows = {r["mode"]: r for r in res[0]["rows"]}
    assert rows == {r["mode"]: r for r in res[1]["rows"]}  # every rank reports the same series
    assert rows["strong"]["total_work"] == 4 and rows["strong"]["work_per_rank"] == 2
    assert rows["strong"]["matmuls"] == 4 and rows["weak"]["matmuls"] == 4  # counts summed over both nodes
    assert rows["strong"]["flops"] == 4 * 2 * 64**3  # sanity: the experiment's formula, by hand
    assert rows["strong"]["flops_counted"] == rows["strong"]["flops"]  # independent: torch's FlopCounterMode
    assert all(r["time_min_s"] <= r["time_s"] <= r["time_max_s"] for r in rows.values())

    # clock alignment: node 1's offset estimate finds the 3 s skew (ping-pong over loopback: ~ms error)
    assert res[0]["clock_offset_ns"] == 0
    assert abs(res[1]["clock_offset_ns"] - SKEW_NS) < 50_000_000, res[1]["clock_offset_ns"]
    tl = res.timeline
    assert set(tl["rank"]) == {0, 1}
    starts = tl.pivot_table(index=["name", "step"], columns="rank", values="start_ns", aggfunc="first")
    assert len(starts) == 6  # 3 timed steps x (strong, weak), both ranks
    gap_s = (starts[1] - starts[0]).abs() / 1e9
    # each step starts right after a barrier: on the common clock both nodes start together; without the
    # correction they would be SKEW_NS apart
    assert gap_s.max() < 0.5, gap_s
    raw_gap_s = ((starts[1] + res[1]["clock_offset_ns"]) - starts[0]) / 1e9
    assert (raw_gap_s > 2.5).all(), raw_gap_s

    series = scaling.from_torchrun([out])
    assert set(series["mode"]) == {"strong", "weak"} and (series["n_nodes"] == 2).all()
    assert (series["speedup"] == 1.0).all()  # sanity, true by definition: a one-point series is its own baseline


def test_sbatch_submits_every_point_with_node_script(tmp_path):
    """scaling.sbatch with a fake srun (records its arguments and environment) and a no-op Python: the steps
    are 1, 2, 4 ranks on one node, then 1 and 2 whole nodes, each on a fresh port, each running node.sh."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "$MASTER_PORT $NPROC_PER_NODE $*" >> {calls}\n')
    (bin_dir / "srun").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update({"PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", "PYTHON": "true", "GPUS_PER_NODE": "8",
                "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "77", "SLURM_SUBMIT_DIR": str(ROOT),
                "OUT": str(tmp_path / "out"), "MASTER_PORT": "31000"})
    proc = subprocess.run(["bash", str(SLURM / "scaling.sbatch")], env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = calls.read_text().splitlines()
    points = [(ln.split()[3], ln.split()[1]) for ln in lines]  # (--nodes N, ranks per node)
    assert points == [("1", "1"), ("1", "2"), ("1", "4"), ("1", "8"), ("2", "8")], lines
    assert [ln.split()[0] for ln in lines] == ["31001", "31002", "31003", "31004", "31005"]
    assert all("examples/slurm/node.sh" in ln and "labkit.experiments.scaling:torchrun_point" in ln for ln in lines)
