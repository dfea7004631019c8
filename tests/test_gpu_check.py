"""The GPU check's CPU-side logic, its skip path, and that it imports nothing a bare GPU box lacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import gpu_check as g

ROOT = Path(__file__).resolve().parent.parent


def torch_alone(where: Path) -> Path:
    """A folder of links to torch and the packages torch requires (its wheel's metadata, recursively), and
    nothing else: with ``python -S`` and this folder on PYTHONPATH an interpreter sees what a GPU machine that
    has only python3 and torch installed sees (no PyYAML, pandas, plotly, papermill, ipywidgets)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    where.mkdir(parents=True, exist_ok=True)
    seen, todo = set(), ["torch"]
    while todo:
        dist = metadata.distribution(todo.pop())
        name = dist.metadata["Name"].lower().replace("_", "-")
        if name in seen:
            continue
        seen.add(name)
        for req in dist.requires or []:
            r = Requirement(req)
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(r.name)
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}:
            src = Path(dist.locate_file(top))
            if src.exists() and not (where / top).exists():
                (where / top).symlink_to(src)
    return where


def _gpu_check(*args, env=None, timeout=180, cwd=None, bare: Path | None = None):
    """``python3 -m labkit.gpu_check ARGS`` in a fresh interpreter; with ``bare`` (a :func:`torch_alone`
    folder) one that sees only torch, its requirements and the checkout."""
    path = f"{ROOT}{os.pathsep}{bare}" if bare else str(ROOT)
    cmd = [sys.executable, *(["-S"] if bare else []), "-P", "-m", "labkit.gpu_check", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path, **(env or {})},
                          cwd=cwd, timeout=timeout)


DRY = ("--cpu-dry-run", "--model", "lab-tiny-llama", "--seq", "16", "--micro-batch", "2", "--steps", "2",
       "--matmul-n", "64", "--collective-bytes", "4096", "--device", "h100-80gb")


def test_skip_is_one_line_and_exit_3_unless_allowed(tmp_path):
    env = {"CUDA_VISIBLE_DEVICES": ""}
    out = _gpu_check("--out", tmp_path / "r.json", env=env, cwd=tmp_path)
    assert out.returncode == g.EXIT_SKIPPED == 3, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: skipped: no CUDA GPU") and "--allow-skip" in lines[0]
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["skipped"].startswith("no CUDA GPU") and "collectives" not in doc
    ok = _gpu_check("--allow-skip", env=env, cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.startswith("gpu-check: skipped:"), ok.stderr


def test_bad_arguments_are_one_line_and_exit_2(tmp_path):
    out = _gpu_check("--layers", "0", cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().count("\n") == 0 and "--layers" in out.stderr and "'0' must be > 0" in out.stderr


def test_torch_alone_has_torch_and_no_yaml_or_tables(tmp_path):
    bare = torch_alone(tmp_path / "site")
    names = {p.name for p in bare.iterdir()}
    assert "torch" in names and not names & {"yaml", "pandas", "plotly", "papermill", "ipywidgets", "_yaml"}
    code = "import importlib.util as u; print([m for m in ('yaml', 'pandas', 'torch') if u.find_spec(m)])"
    out = subprocess.run([sys.executable, "-S", "-P", "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(bare)})
    assert out.stdout.strip() == "['torch']", out.stderr


def test_cpu_dry_run_of_the_whole_path_with_torch_alone(tmp_path):
    """Every stage on gloo/CPU in an interpreter that has torch (and what torch requires) and nothing else: the
    data files come from labkit.yamlload's reader, the record is complete and the checks pass."""
    bare = torch_alone(tmp_path / "site")
    out = _gpu_check(*DRY, "--out", f"{tmp_path / 'rec'}/", env={"CUDA_VISIBLE_DEVICES": ""}, cwd=tmp_path,
                     bare=bare)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all checks passed" in out.stdout and "gloo all_reduce" in out.stdout
    (path,) = (tmp_path / "rec").glob("*_h100-80gb.json")  # --out DIR/: <stamp>_<device>.json inside it
    doc = json.loads(path.read_text())
    assert doc["format"] == g.FORMAT and doc["dry_run"] is True
    assert list(doc["stages"]) == list(g.STAGES) and all(s["status"] == "ok" for s in doc["stages"].values())
    assert all(r["ok"] for r in doc["collectives"]) and [r["op"] for r in doc["collectives"]] == list(g.COLLECTIVES)
    assert all(doc["memory"][c]["ok"] for c in ("parameters", "gradients", "optimizer"))
    assert 0 < doc["matmul_mfu"] <= 1 and 0 < doc["train_step_mfu"] <= 1 and doc["peak_bf16_tflops"] == 989


def test_a_stage_that_raises_is_recorded_and_the_next_stages_still_run(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("NCCL error: unhandled system error\nsecond line")

    monkeypatch.setattr(g, "run_matmul", boom)
    saved = []
    real_write = g.write_record
    monkeypatch.setattr(g, "write_record", lambda result, out=None: saved.append(
        sorted(result["stages"])) or real_write(result, out))
    rc = g.main([*DRY, "--out", str(tmp_path / "r.json")])
    doc = json.loads((tmp_path / "r.json").read_text())
    assert rc == 1
    assert doc["stages"]["matmul"]["status"] == "error"
    assert doc["stages"]["matmul"]["error"] == "RuntimeError: NCCL error: unhandled system error"
    assert doc["stages"]["model_slice"]["status"] == "ok" and "memory" in doc  # the stage after it ran
    assert doc["stages"]["mfu"]["status"] == "error" and "matmul" in doc["stages"]["mfu"]["error"]
    assert any("stage matmul raised RuntimeError" in f for f in g.failures(doc))
    # written after every stage, not once at the end
    assert saved == [sorted(g.STAGES[: i + 1]) for i in range(len(g.STAGES))]


def test_the_time_limit_ends_the_check_and_the_record_says_where(tmp_path):
    out = _gpu_check(*DRY[:-8], "--steps", "100000", "--time-limit", "4", "--out", tmp_path / "t.json",
                     cwd=tmp_path, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["timed_out"]["limit_s"] == 4 and doc["timed_out"]["stage"] in g.STAGES
    assert doc["timed_out"]["stage"] not in doc["stages"]  # the stage it stopped in never finished
    assert "still running at the time limit (4 s)" in out.stdout
    assert any("time limit" in f for f in g.failures(doc))


def test_imports_no_notebook_or_table_packages():
    code = ("import sys; import labkit.gpu_check as g, labkit.models, labkit.theory.memory, labkit.paths; "
            "g.slice_spec(); print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'yaml', 'pandas', 'plotly', 'papermill', 'ipywidgets', 'matplotlib'}))")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("[]", "['yaml']")  # yaml only where installed (read with it then)


@pytest.mark.parametrize("name, device", [("NVIDIA H100 80GB HBM3", "h100-80gb"), ("NVIDIA H200", "h200-141gb"),
                                          ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
                                          ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
                                          ("Tesla T4", None)])
def test_device_names_match_hardware_yaml(name, device):
    from labkit.theory import memory as mem

    assert g.match_device(name) == device
    if device:
        assert mem.get_device(device)["peak_bf16_tflops"] > 0


def test_every_collective_on_gloo_world_one():
    rows = g.run_collectives("gloo", "cpu", nbytes=4096, iters=2)
    assert [r["op"] for r in rows] == list(g.COLLECTIVES)
    assert all(r["ok"] for r in rows), rows
    assert all(r["ms"] > 0 for r in rows if r["ok"])


def test_model_slice_states_equal_the_calculator_on_cpu():
    spec = g.slice_spec("lab-tiny-llama", layers=2)
    s = g.run_model_slice(spec, micro_batch_size=2, seq_len=16, steps=2, device="cpu", dtype_name="float32")
    pred = g.predicted_train_memory(spec, 2, 16, convention="torch-fp32", kernels="cpu")
    rows = g.compare_memory(s["measured"], pred, s["peak_allocated_bytes"])
    assert all(rows[c]["ok"] for c in ("parameters", "gradients", "optimizer")), rows
    assert rows["peak"]["measured_bytes"] is None and s["step_ms"] > 0
    assert s["n_params"] == spec.n_params()


def test_full_size_slice_is_llama_3_8b_layers():
    spec = g.slice_spec("llama-3-8b", layers=2)
    assert (spec.n_layers, spec.hidden_size, spec.ffn_hidden_size, spec.vocab_size) == (2, 4096, 14336, 128256)
    pred = g.predicted_train_memory(spec, 1, 2048)
    assert pred["parameters"] == 2 * spec.n_params()  # bf16


def _fake_result(ok=True, mfu=0.6):
    return {"identity": {"gpu": "NVIDIA H100 80GB HBM3"}, "device": "h100-80gb", "peak_bf16_tflops": 989,
            "collectives": [{"op": "all_reduce", "ok": ok, "ms": 1.0, "algbw_gbps": 60.0, "bytes": 2**26}],
            "matmul": {"n": 8192, "dtype": "bfloat16", "tflops": 700.0, "wall_ms": 1.6, "event_ms": 1.57},
            "matmul_mfu": mfu, "train_step_mfu": 0.4,
            "slice": {"model": "llama-3-8b", "layers": 2, "tokens_per_step": 2048, "step_ms": 50.0},
            "memory": g.compare_memory({"parameters": 10, "gradients": 10, "optimizer": 20},
                                       {"parameters": 10, "gradients": 10, "optimizer": 20, "activations": 5}, 50)}


def test_failures_summary_and_record(tmp_path):
    assert g.failures(_fake_result()) == []
    assert "all_reduce: wrong values" in g.failures(_fake_result(ok=False))
    assert any("outside (0, 1]" in f for f in g.failures(_fake_result(mfu=1.7)))
    text = g.summary(_fake_result())
    assert "all checks passed" in text and "700 TFLOP/s" in text and "MFU 60.0%" in text
    path = g.write_record(_fake_result(), tmp_path / "x" / "rec.json")
    doc = json.loads(path.read_text())
    assert doc["format"] == g.FORMAT and doc["memory"]["peak"]["ratio"] == 50 / 45
    assert g.mfu(494.5e12, 989) == pytest.approx(0.5)


def test_main_writes_a_record_and_exits_by_the_checks(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(g, "skip_reason", lambda: None)

    def fake_run(args, check):
        check.result.update(_fake_result(ok=args.layers == 2))
        check.save()
        return check.result

    monkeypatch.setattr(g, "run", fake_run)
    assert g.main(["--out", str(tmp_path / "a.json")]) == 0
    assert (tmp_path / "a.json").exists() and "record:" in capsys.readouterr().out
    assert g.main(["--layers", "3", "--out", str(tmp_path / "b.json")]) == 1
    assert g.main(["--out", str(tmp_path)]) == 0  # a folder: <stamp>_<device>.json inside it
    assert len(list(tmp_path.glob("*_h100-80gb.json"))) == 1
