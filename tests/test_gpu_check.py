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


def test_skips_with_one_line_where_no_gpu(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-P", "-m", "labkit.gpu_check", "--out", str(tmp_path / "r.json")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: skipped: no CUDA GPU")
    assert not (tmp_path / "r.json").exists()


def test_imports_no_notebook_or_table_packages():
    code = ("import sys; import labkit.gpu_check as g, labkit.models, labkit.theory.memory, labkit.paths; "
            "g.slice_spec(); print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'pandas', 'plotly', 'papermill', 'ipywidgets', 'matplotlib'}))")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


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
    monkeypatch.setattr(g, "run", lambda args: _fake_result(ok=args.layers == 2))
    assert g.main(["--out", str(tmp_path / "a.json")]) == 0
    assert (tmp_path / "a.json").exists() and "record:" in capsys.readouterr().out
    assert g.main(["--layers", "3", "--out", str(tmp_path / "b.json")]) == 1
