"""labkit.runtime.measure (the tools) and labkit.experiments.memory (the run): measured memory equals
labkit.theory.memory's prediction on the lab's model.

Model states (parameters, gradients, AdamW state) must match to the byte; saved activations within 5 % (the
issue's bar) — and, on torch 2.13 on CPU, to the byte (the lab's derivation in labkit.theory.memory.activation_items).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from labkit import launch
from labkit.experiments.memory import RANK_OVERHEAD_BYTES, check_training_run, measure_training_rank
from labkit.runtime.measure import SavedActivations, cuda_memory, host_memory_bytes, model_state_bytes, tensor_bytes
from labkit.theory import memory as mem
from labkit.theory.spec import get_spec

CPU_CTX = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"), sync=lambda: None, barrier=lambda: None)
TORCH_213 = torch.__version__.startswith("2.13")


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)])
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: counted once

    def forward(self, x):
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def test_model_state_bytes_counts_tied_weights_once_and_optimizer_state():
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt.step()
    n = 10 * 4 + 2 * (4 * 4 + 4)
    got = model_state_bytes(model, opt)
    assert got == {"parameters": 4 * n, "gradients": 4 * n, "optimizer": 8 * n + 4 * 5}  # 5 tensors' steps


def test_saved_activations_dedupe_and_exclusions():
    model = Tied()
    x = torch.tensor([[1, 2, 3]])
    with SavedActivations(model) as acts:
        model(x).sum()
    tab = acts.table()
    # weights saved by the linear layers are model state, never activations
    assert tab[tab.model_state].shape[0] >= 3
    assert acts.by_label["first_stage"] == x.numel() * 8  # the token ids, int64
    # layer i saves its input (4 floats x 3 tokens) and tanh's output; layer 1's input is layer 0's tanh output,
    # already counted in layer 0: the storage is counted once, where it was first saved
    assert acts.per_layer == [2 * 12 * 4, 12 * 4]
    assert acts.by_label.get("last_stage", 0) == 0  # the head's input was saved (and counted) by layer 1's tanh


def test_a_view_counts_its_whole_storage():
    big = torch.randn(100, 8, requires_grad=True)
    model = nn.Module()
    with SavedActivations(model, layers=[]) as acts:
        y = big * 2
        (y[:2] * y[:2]).sum()  # mul saves two views of y's storage: counted once, all 100 x 8 floats
    assert acts.total_bytes == 100 * 8 * 4


def test_cuda_memory_is_none_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert cuda_memory() is None and cuda_memory("cpu") is None


CONFIGS = [
    ("lab-tiny-llama", "sdpa", None, "float32"),
    ("lab-tiny-llama", "eager", 0.1, "float32"),
    ("lab-tiny-llama", "sdpa", None, "bfloat16"),
    ("lab-tiny-gpt", "sdpa", None, "float32"),
    ("lab-tiny-gpt", "sdpa", 0.1, "float32"),  # SDPA with dropout on CPU: the math fallback
    ("lab-tiny-gpt", "eager", 0.1, "bfloat16"),
]


@pytest.mark.parametrize("model, attention, dropout, dtype", CONFIGS)
def test_single_rank_measured_vs_predicted(model, attention, dropout, dtype):
    r = measure_training_rank(CPU_CTX, model, micro_batch_size=2, seq_len=40, attention=attention, dropout=dropout,
                              dtype=dtype)[0]
    me, pr = r["measured"], r["predicted"]
    for cat in ("parameters", "gradients", "optimizer"):
        assert me[cat] == pr[cat], (cat, me[cat], pr[cat])
    assert me["activations"] == pytest.approx(pr["activations"], rel=0.05)
    for layer in r["activations_per_layer"]:
        assert layer == pytest.approx(r["predicted_per_layer"], rel=0.05)
    if TORCH_213:  # the derivation is exact for the torch it was written against
        assert me["activations"] == pr["activations"]
        assert set(r["activations_per_layer"]) == {r["predicted_per_layer"]}


def test_pipeline_and_recompute_do_not_change_the_per_layer_formula():
    spec = get_spec("lab-tiny-llama")
    train = mem.TrainConfig(micro_batch_size=2, seq_len=40, convention="torch-fp32", kernels="cpu")
    per_layer = mem.activation_bytes_per_layer(spec, train)
    r = measure_training_rank(CPU_CTX, "lab-tiny-llama", micro_batch_size=2, seq_len=40)[0]
    assert r["predicted_per_layer"] == per_layer
    full = mem.activation_bytes_per_layer(spec, mem.TrainConfig(micro_batch_size=2, seq_len=40, recompute="full",
                                                                convention="torch-fp32", kernels="cpu"))
    assert full == 2 * 40 * 64 * 4  # only the layer input is kept


def test_distributed_ddp_and_fsdp2_on_gloo():
    """One launch, three ranks: the single-rank reference, DDP (replicated) and FSDP2 (ZeRO-3) per rank. Three
    does not divide the model's dim-0 sizes, so FSDP2's torch.chunk shards are uneven (tester report item 7):
    the prediction is per rank and still equal to the byte."""
    world = 3
    res = launch(measure_training_rank, world, "lab-tiny-llama", micro_batch_size=2, seq_len=32,
                 wraps=("none", "ddp", "fsdp2"), backend="gloo", echo=False, timeout_s=240)
    assert len(res) == world
    n_tensors = len(mem.param_tensors(get_spec("lab-tiny-llama")))
    shards = []
    for rank_results in res:
        by_wrap = {r["wrap"]: r for r in rank_results}
        for wrap, r in by_wrap.items():
            me, pr = r["measured"], r["predicted"]
            for cat in ("parameters", "gradients", "optimizer"):
                assert me[cat] == pr[cat], (wrap, r["rank"], cat, me[cat], pr[cat])
            assert me["activations"] == pytest.approx(pr["activations"], rel=0.05), wrap
        full = by_wrap["none"]["measured"]
        assert by_wrap["ddp"]["measured"] == full  # DDP replicates everything
        z3 = by_wrap["fsdp2"]["measured"]
        shards.append(z3)
        assert z3["optimizer"] == 2 * z3["parameters"] + 4 * n_tensors  # moments sharded, steps stay per tensor
        assert z3["activations"] == full["activations"]  # ZeRO does not shard activations
    for cat in ("parameters", "gradients"):  # the shards partition the model, unevenly
        assert sum(z[cat] for z in shards) == full[cat]
    params = [z["parameters"] for z in shards]
    assert len(set(params)) > 1 and params[0] == max(params)  # rank 0 holds the most (chunks of ceil(d0/3))
    assert res[0][0]["loss"] == pytest.approx(res[0][1]["loss"])  # none vs ddp: the same first-step loss


def test_check_training_run_refuses_what_the_host_cannot_hold():
    host = host_memory_bytes()
    assert host is None or host > 2**28
    need = check_training_run("lab-tiny-llama", 2, wraps=("none", "ddp", "fsdp2"), host_bytes=10**10)
    assert need["needed_bytes"] == 2 * need["per_rank_bytes"] and need["per_rank_bytes"] > RANK_OVERHEAD_BYTES
    assert "GB predicted (2 ranks x" in need["summary"] and "this machine 10.0 GB (measured)" in need["summary"]
    # the tester's case: llama-3-8b was OOM-killed after 44 s; now refused before launch, in one line
    with pytest.raises(ValueError, match=r"model='llama-3-8b' on world_size=2 ranks needs about 2\d\d\.\d GB of "
                                         r"host memory .* but this machine has 24\.0 GB; valid models here: "
                                         r"lab-small-llama,"):
        check_training_run("llama-3-8b", 2, host_bytes=24 * 10**9)
    assert check_training_run("llama-3-8b", 2, host_bytes=10**12)["needed_bytes"] > 2 * 10**11
    # MoE activations are the lab's estimate: refused where a caller checks activations to a few per cent
    assert check_training_run("lab-tiny-moe", 2, host_bytes=10**10)["needed_bytes"] > 0
    with pytest.raises(ValueError, match=r"model='lab-tiny-moe' has mixture-of-experts layers.*valid models here: "
                                         r"lab-small-llama, lab-tiny-gpt, lab-tiny-llama$"):
        check_training_run("lab-tiny-moe", 2, host_bytes=10**10, exact_activations=True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=0), "world_size=0 must be an integer >= 1"),
    (dict(seq_len=4096), "seq_len=4096 exceeds model 'lab-tiny-llama''s max_seq_len=128; use seq_len <= 128"),
    (dict(micro_batch_size=0), "micro_batch_size=0 must be an integer >= 1"),
    (dict(wraps=("zero2",)), "wrap='zero2' is not valid"),
    (dict(attention="flash"), "attention='flash' is not valid; choose one of: sdpa, eager"),
])
def test_check_training_run_bad_arguments(kwargs, match):
    kw = dict(world_size=2) | kwargs
    with pytest.raises(ValueError, match=match):
        check_training_run("lab-tiny-llama", kw.pop("world_size"), **kw)


def test_tensor_bytes_of_a_dtensor_is_its_local_shard():
    from torch.distributed.tensor import DTensor

    assert tensor_bytes(torch.zeros(3, 5)) == 60
    assert hasattr(DTensor, "to_local")  # the distributed case is checked in test_distributed_ddp_and_fsdp2_on_gloo


@pytest.mark.slow
def test_chapter01_at_world_size_3_and_every_number_labelled(tmp_path):
    """Chapter 01 at world_size=3 (FSDP2's uneven dim-0 shards, tester report item 7) runs clean, and every output
    that shows a number says whether it is measured or predicted (item 16)."""
    import re

    import nbformat

    from labkit import notebooks
    from labkit.paths import notebooks_dir

    path = notebooks_dir() / "01_memory_budgets.ipynb"
    row = notebooks.run_notebook(path, tmp_path / path.name, {"world_size": 3}, cell_timeout_s=300)
    assert row["status"] == "ok", row["error"]
    nb = nbformat.read(row["output"], as_version=4)
    unlabelled = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            text = out.get("text") if out.output_type == "stream" else out.get("data", {}).get("text/plain", "")
            if "VBox(" in text or not re.search(r"(?<![A-Za-z])\d", text):
                continue  # the widget's repr; no numbers (a dtype name such as fp32 is not a number)
            if text.lstrip().startswith("not attempted yet"):
                continue  # the exercise's hint ("a 4-byte step per tensor"): a fact to use, not a result
            if not re.search(r"predicted|measured|published", text, re.IGNORECASE):
                unlabelled.append((i, text[:120]))
    assert not unlabelled, unlabelled


# ------------------------------------------------------------------------------------------------------
# chapter 01: every parameter checked before any launch
# ------------------------------------------------------------------------------------------------------
#: chapter 01's parameters: its profile is ``cluster`` (5db7c38: it only names the GPU that sizes the tables, nothing
#: in chapter 01 is emulated)
CH01 = dict(world_size=2, cluster="dgx-h100", my_prediction=None, model="lab-tiny-llama", micro_batch_size=2,
            seq_len=64, attention="sdpa", big_model="llama-3-70b", device="h100-80gb", timeout_s=240.0)


def test_chapter01_first_cell_validates_every_parameter_through_check_chapter(monkeypatch):
    import ast

    import nbformat

    import labkit
    import labkit.runtime.launcher
    from labkit import notebooks
    from labkit.paths import notebooks_dir

    def no_launch(*a, **k):
        raise AssertionError("launched before validating the parameters")

    monkeypatch.setattr(labkit.runtime.launcher, "launch", no_launch)
    monkeypatch.setattr(labkit, "launch", no_launch)
    path = notebooks_dir() / "01_memory_budgets.ipynb"
    cells = nbformat.read(str(path), 4).cells
    i = next(i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", []))
    first = next(c.source for c in cells[i + 1:] if c.cell_type == "code")
    calls = [n for n in ast.walk(ast.parse(first)) if isinstance(n, ast.Call)
             and getattr(n.func, "attr", "") == "check_chapter"]
    assert len(calls) == 1, "the first code cell validates through one ch.check_chapter call"
    assert {k.arg for k in calls[0].keywords} == set(notebooks.declared_parameters(path)) == set(CH01)
    ns = {}
    exec(cells[i].source, ns)
    ns["world_size"] = 1
    with pytest.raises(ValueError, match=r"chapter 01 needs world_size >= 2, got world_size=1: .*use world_size=2"):
        exec(first, ns)  # nothing launched yet


@pytest.mark.parametrize("key, value, match", [
    ("world_size", 0, "world_size=0"),
    ("cluster", "nope", "cluster='nope'.*choose one of: dgx-h100"),
    ("model", "nope", "unknown model preset 'nope'"),
    ("model", "lab-tiny-moe", "mixture-of-experts"),
    ("micro_batch_size", 0, "micro_batch_size=0"),
    ("seq_len", 10**6, "max_seq_len"),
    ("attention", "flash", "attention='flash' is not valid"),
    ("big_model", "nope", "big_model='nope'"),
    ("device", "nope", "device='nope'.*valid devices"),
    ("timeout_s", 0, "timeout_s=0"),
])
def test_chapter01_check_chapter_refuses_each_bad_parameter(key, value, match):
    from labkit.chapters import ch01_memory_budgets as ch

    assert "predicted" in ch.check_chapter(**CH01)["summary"]
    with pytest.raises(ValueError, match=match):
        ch.check_chapter(**{**CH01, key: value})


def test_chapter01_prediction_uses_the_runs_calculator_settings():
    """The notebook's TrainConfig (section 1) predicts what measure_training_rank predicts for the same run."""
    from labkit.experiments.memory import train_config

    spec = get_spec("lab-tiny-llama")
    notebook = mem.TrainConfig(micro_batch_size=2, seq_len=64, convention="torch-fp32", attention="flash",
                               kernels="cpu", act_dtype="fp32")
    run = train_config(spec, 2, 64, "sdpa", "float32", "cpu")
    assert mem.train_memory(spec, train=notebook).categories == mem.train_memory(spec, train=run).categories
