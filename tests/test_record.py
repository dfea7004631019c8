"""labkit record: the sweeps' sizes, the CLI end to end at small sizes (rows in the recording schema, labelled
measured), the bare python3 + torch path (no pandas, no cloudpickle: the spawn runner), and bad input."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.cli import main
from labkit.commands import record as cmd
from labkit.experiments import record as rec

ROOT = Path(__file__).resolve().parent.parent


def test_sizes_and_parse_bytes():
    assert rec.collective_sizes(1 << 20) == [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20]
    assert rec.collective_sizes(1 << 20, quick=True) == [1 << 10, 1 << 14, 1 << 18]
    assert rec.memory_sizes(64 << 10) == [1024, 4096, 16384]
    assert rec.default_max_size(False, 2) <= 64 << 20 and rec.default_max_size(False, 2, quick=True) <= 1 << 20
    assert cmd.parse_bytes("64M") == 64 << 20 and cmd.parse_bytes("4096") == 4096 and cmd.parse_bytes("1g") == 1 << 30
    for bad in ("0", "-1", "1.5M", "1T", "", "x"):
        with pytest.raises(ValueError, match="must be a size"):
            cmd.parse_bytes(bad)
    shapes = rec.gemm_shapes(False)
    assert (1024, 1024, 1024) in shapes and any(m == 1 for m, _, _ in shapes) and any(k <= 32 for *_, k in shapes)


def test_step_seconds_takes_the_slowest_rank_and_skips_warmup():
    spans = [(0, 9.0), (0, 8.0), (1, 0.5), (1, 0.7), (2, 0.6), (2, 0.4)]
    assert rec.step_seconds(spans) == pytest.approx(0.6)  # max over ranks per step, then the fastest step
    with pytest.raises(ValueError, match="no step spans"):
        rec.step_seconds([])


def test_compress_trace_counts_distinct_operations():
    ev = [("c", 0, 1, 10, 20, "float32"), ("c", 1, 2, 10, 20, "float32"), ("send", 3), ("c", 2, 3, 0, 8, "bfloat16")]
    assert rec.compress_trace(ev) == [[0, 8, "bfloat16", 1], [10, 20, "float32", 2]]


def _read(folder):
    with open(folder / "recording.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_cli_record_end_to_end_small(tmp_path, capsys):
    out = tmp_path / "rec"
    assert main(["record", "--out", str(out), "--quick", "--only", "gemm,memory,collectives",
                 "--max-size", "4K", "--machine", "test box"]) == 0
    rows = _read(out)
    assert list(rows[0]) == list(rec.COLUMNS)
    kinds = {r["kind"] for r in rows}
    assert kinds == {"gemm", "memory", "collective"}
    ops = {r["op"] for r in rows if r["kind"] == "collective"}
    assert set(rec.OPS) == ops
    timed = [r for r in rows if r["seconds"]]
    assert timed and all(float(r["seconds"]) > 0 for r in timed)
    assert all(r["label"] == "measured (test box)" and r["torch"] and r["device"] for r in rows)
    assert max(int(r["bytes"]) for r in rows if r["kind"] == "collective") == 1024  # 4K quick: 1K only
    ident = json.loads((out / "identity.json").read_text())
    assert ident["machine"] == "test box" and ident["format"] == "labkit-recording/1" and ident["rows"] == len(rows)
    assert "labelled measured (test box)" in capsys.readouterr().out


def test_record_runs_on_bare_python_and_torch(tmp_path):
    """No pandas, no cloudpickle (a lent GPU machine's python3): the spawn runner measures instead of launch."""
    code = ("import sys; sys.modules['pandas'] = None; sys.modules['cloudpickle'] = None; "
            "from labkit.commands.record import main; "
            f"raise SystemExit(main(['--out', {str(tmp_path / 'bare')!r}, '--quick', '--only', 'gemm,collectives', "
            "'--max-size', '1K']))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = _read(tmp_path / "bare")
    assert {r["kind"] for r in rows} == {"gemm", "collective"}
    assert all(float(r["seconds"]) > 0 for r in rows if r["kind"] == "gemm")
    assert not rec.full_launch_available() or "pandas" not in p.stderr


@pytest.mark.parametrize("args, needle", [
    (["--only", "gemm,disk"], "--only='gemm,disk'"),
    (["--max-size", "12X"], "--max-size='12X'"),
    (["--max-size", "999999999G"], "does not fit"),
    (["--world-size", "0"], "--world-size=0"),
    (["--timeout", "nan"], "--timeout=nan"),
])
def test_cli_record_bad_input_is_one_line_exit_2(args, needle, tmp_path, capsys):
    assert main(["record", "--out", str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err
