"""Sharded data parallelism (labkit.parallel.zero; runs in labkit.experiments.zero) on gloo: ZeRO-1/2/3 from
scratch and FSDP2 against the single-process reference, replicas identical, model-state bytes per rank and
communication bytes equal to theory, and the FSDP2 wrong-device field case.

Two launches (2 and 4 ranks); each checks several variants. Tolerance: labkit.models.TOLERANCES[fp32].
"""

from __future__ import annotations

import pytest
import torch

from labkit import launch
from labkit.chapters import ch04_zero_fsdp as ch
from labkit.experiments import zero as zx
from labkit.experiments.common import GLOO, RING, SOCKET, assert_ranks_identical, assert_state_close, wire_table
from labkit.models import TOLERANCES, build_model, train_reference
from labkit.parallel import zero
from labkit.parallel.zero.units import _Unit
from labkit.theory import zero as zt
from labkit.theory.spec import get_spec

MODEL = "lab-tiny-llama"
STEPS, GLOBAL_BATCH, SEQ = 3, 8, 16
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": 3}
RUNS_2 = [{"variant": v} for v in zt.VARIANTS] + [
    {"variant": "zero1", "n_microbatches": 2, "label": "zero1-acc"},
    {"variant": "zero2", "n_microbatches": 2, "label": "zero2-acc"},
    {"variant": "zero3", "n_microbatches": 2, "label": "zero3-acc"},
    {"variant": "fsdp2", "n_microbatches": 2, "label": "fsdp2-acc"},
    {"variant": "zero1", "n_microbatches": 2, "sync_microbatch": 0, "label": "zero1-wrong-sync"},
]
RUNS_4 = [{"variant": v} for v in zt.VARIANTS] + [{"variant": "zero3", "n_microbatches": 2, "label": "zero3-acc"}]


def rank_fn(ctx, runs):
    """Test rank function: the variants, then the FSDP2 wrong-device field case on a real gloo group (a model
    whose parameters are on the meta device must give ValueError, not a crash)."""
    out = zx.run_rank(ctx, runs, model=MODEL, steps=STEPS, global_batch_size=GLOBAL_BATCH, seq_len=SEQ)
    errors = []
    try:
        zero.fsdp2(_meta_model(), ctx)
    except ValueError as e:
        errors.append(str(e))
    return {"runs": out, "errors": errors}


def _meta_model():
    from labkit.models import Transformer

    with torch.device("meta"):
        return Transformer(get_spec(MODEL))


@pytest.fixture(scope="module")
def reference():
    return train_reference(MODEL, steps=STEPS, global_batch_size=GLOBAL_BATCH, seq_len=SEQ)


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=["2ranks", "4ranks"])
def launched(request):
    n = request.param
    return n, launch(rank_fn, n, RUNS_2 if n == 2 else RUNS_4, timeout_s=300)


def _by_label(res):
    runs = [r["runs"] for r in res]
    return {runs[0][i]["label"]: [rr[i] for rr in runs] for i in range(len(runs[0]))}


def check_run(per_rank: list[dict], ref: dict) -> None:
    label = per_rank[0]["label"]
    assert_ranks_identical([r["state"] for r in per_rank], f"{label} weights")
    assert_state_close(per_rank[0]["state"], ref["state_dict"], torch.float32, f"{label} weights")
    torch.testing.assert_close(per_rank[0]["losses"], ref["losses"], **TOLERANCES[torch.float32])


def test_parity_with_reference_and_replicas_identical(launched, reference):
    n, res = launched
    for label, per_rank in _by_label(res).items():
        if "wrong" not in label:
            check_run(per_rank, reference)


def test_zero1_wrong_sync_microbatch_is_caught(launched, reference):
    """ZeRO-1's all-gather keeps replicas identical even with the sync on the wrong micro-batch, so only the
    comparison with the reference can catch it: it must."""
    n, res = launched
    if n != 2:
        pytest.skip("run at 2 ranks only")
    per_rank = _by_label(res)["zero1-wrong-sync"]
    assert_ranks_identical([r["state"] for r in per_rank])
    with pytest.raises(AssertionError):
        check_run(per_rank, reference)


def test_model_state_bytes_equal_calculator(launched):
    """Measured (labkit.runtime.measure, live tensors) = predicted (labkit.theory.memory, convention "torch-fp32":
    Rajbhandari et al. 2020 Figure 1 with 4 + 4 + 8 bytes per parameter) for every stage, on every rank, to
    the byte. AdamW's 4-byte step counters are one per parameter tensor for DDP and FSDP2 (as the calculator
    assumes) but one per flat unit for the lab's ZeRO, so they are compared apart."""
    n, res = launched
    predicted = ch.predicted_table(MODEL, [n]).set_index("variant")
    n_units = get_spec(MODEL).n_layers + 1
    for label, per_rank in _by_label(res).items():
        v = per_rank[0]["variant"]
        pred = predicted.loc[v]
        for r in per_rank:
            got = r["memory"]
            assert got["parameters"] == pred["parameters"], label
            assert got["gradients"] == pred["gradients"], label
            assert got["optimizer"] - r["optimizer_steps"] == pred["optimizer"] - pred["optimizer_steps"], label
            if v in ("ddp", "fsdp2"):
                assert got["optimizer"] == pred["optimizer"], label
            else:
                assert r["optimizer_steps"] == 4 * n_units, label


def test_comm_bytes_equal_theory(launched):
    """Bytes per rank per step, per collective, equal predicted_comm_bytes; ZeRO-3 (and FSDP2) send
    (3Ψ - Ψ_root)/(2Ψ) times DDP's bytes, i.e. between 1x and the paper's 1.5x."""
    n, res = launched
    spec = get_spec(MODEL)
    psi = spec.n_params()
    root = zt.root_params(spec)  # embeddings, final norm, head: gathered once per micro-batch
    for label, per_rank in _by_label(res).items():
        r0 = per_rank[0]
        pred = zt.predicted_comm_bytes(STAGE[r0["variant"]], n, psi, root_params=root,
                                         n_microbatches=2 if "acc" in label else 1)
        got = {op: c["bytes_per_rank"] for op, c in r0["comm"].items()}
        assert got == pytest.approx(pred, rel=1e-9), label
    by = _by_label(res)
    ratio = by["zero3"][0]["ring_bytes_per_step"] / by["ddp"][0]["ring_bytes_per_step"]
    assert ratio == pytest.approx((3 * psi - root) / (2 * psi))
    assert 1.0 < ratio < 1.5
    assert by["fsdp2"][0]["ring_bytes_per_step"] == pytest.approx(by["zero3"][0]["ring_bytes_per_step"])
    table = ch.comm_table(res, MODEL)
    assert (table[ch.RING] - table[ch.PREDICTED]).abs().max() <= 1e-9 * table[ch.PREDICTED].max()


def test_socket_bytes_follow_gloos_algorithms(launched):
    """Measured socket bytes (gloo) sit beside the ring model and do NOT equal it for ZeRO: gloo's
    reduce-scatter runs a whole all-reduce (chapter 02), so the measurement follows the gloo model (within
    a few percent of headers), 1.5x the ring bytes for ZeRO-1/2."""
    from labkit.runtime.probes import socket_bytes_written

    n, res = launched
    if socket_bytes_written() is None:
        pytest.skip("no /proc/self/io on this platform")
    wire = wire_table(res).set_index("label")
    assert ((wire["measured / gloo model"] >= 1.0) & (wire["measured / gloo model"] < 1.1)).all(), wire
    z1 = wire.loc["zero1"]
    assert z1[GLOO] == pytest.approx(1.5 * z1[RING]) and z1[SOCKET] > 1.4 * z1[RING]


def test_fsdp2_wrong_device_is_a_clear_error(launched):
    """Field case (pytorch/pytorch#132471): FSDP2 on a gloo group with parameters on a device gloo does not
    serve must raise ValueError naming the parameter and the valid choices, not crash."""
    n, res = launched
    errors = res[0]["errors"]
    assert len(errors) == 1
    assert "parameter 'embed.weight' is on meta" in errors[0] and "'gloo'" in errors[0] and "'cpu'" in errors[0]


# ------------------------------------------------------------------------------------------------------
# no launch
# ------------------------------------------------------------------------------------------------------
def test_measure_counts_flat_zero_buffers_once():
    """labkit.runtime.measure on the flat ZeRO layout (no process group needed, rank 0 of n = 2): stage 1 shards are
    views of the flat parameters and gradients (counted once); stage 3 parameters live in a freed storage
    between uses (counted 0), leaving the 1/n shard."""
    from labkit.runtime.measure import model_state_bytes

    for stage in (1, 3):
        holder = torch.nn.Module()
        holder.a, holder.b = torch.nn.Linear(4, 6), torch.nn.Linear(2, 2)  # 30 + 6 = 36 parameters
        unit = _Unit("u", list(holder.named_parameters()), n=2, rank=0, stage=stage)
        holder.shards = torch.nn.ParameterList([unit.shard])
        unit.zero_grad(set_to_none=False)
        assert unit.numel == unit.padded == 36
        expected = 4 * 36 if stage == 1 else 4 * 18
        assert model_state_bytes(holder) == {"parameters": expected, "gradients": expected, "optimizer": 0}


def test_comm_formula():
    base = sum(zt.predicted_comm_bytes(0, 8, 1000).values())
    assert base == pytest.approx(2 * 7 / 8 * 4000)
    assert sum(zt.predicted_comm_bytes(1, 8, 1000).values()) == pytest.approx(base)
    assert sum(zt.predicted_comm_bytes(3, 8, 1000).values()) == pytest.approx(1.5 * base)
    with pytest.raises(ValueError, match="stage=4"):
        zt.predicted_comm_bytes(4, 8, 1000)
    with pytest.raises(ValueError, match="root_params=-1"):
        zt.predicted_comm_bytes(3, 8, 1000, root_params=-1)
    with pytest.raises(ValueError, match="root_params=2000 exceeds n_params=1000"):
        zt.predicted_comm_bytes(3, 8, 1000, root_params=2000)
    with pytest.raises(ValueError, match="bytes_per_element=0"):
        zt.predicted_comm_bytes(0, 8, 1000, bytes_per_element=0)
    assert "Raises:" in zt.predicted_comm_bytes.__doc__


def _flat_units(model, d, rank, stage):
    """The lab's ZeRO units of ``model`` (root first, then each layer) built without a process group."""
    layer_params = {p for layer in model.layers for p in layer.parameters()}
    root = [(q, p) for q, p in model.named_parameters() if p not in layer_params]
    groups = [root] + [[(f"layers.{i}.{q}", p) for q, p in layer.named_parameters()]
                       for i, layer in enumerate(model.layers)]
    return [_Unit(f"u{i}", g, n=d, rank=rank, stage=stage) for i, g in enumerate(groups)]


@pytest.mark.parametrize("model_name", [MODEL, "lab-tiny-gpt"])
def test_layout_bytes_equal_the_live_layout_at_uneven_degrees(model_name):
    """Where d does not divide the sizes the paper's Ψ/d is not what ranks hold: the lab's ZeRO pads each unit
    to a multiple of d, FSDP2 cuts dim 0 as torch.chunk does. layout_bytes predicts both, rank by rank,
    checked here against live tensors (labkit.runtime.measure on _Unit's flat buffers; torch.chunk for FSDP2)."""
    from labkit.runtime.measure import model_state_bytes

    d = 3
    for stage, variant in ((1, "zero1"), (2, "zero2"), (3, "zero3")):
        for rank in range(d):
            model = build_model(model_name)
            units = _flat_units(model, d, rank, stage)
            holder = torch.nn.Module()
            holder.model, holder.shards = model, torch.nn.ParameterList([u.shard for u in units])
            for u in units:
                u.zero_grad(set_to_none=False)
            got = model_state_bytes(holder)
            want = zt.layout_bytes(model_name, d, variant, rank)
            assert (got["parameters"], got["gradients"]) == (want["parameters"], want["gradients"]), (variant, rank)
            assert want["optimizer"] == 2 * 4 * sum(u.k for u in units) + 4 * len(units)
    params = list(build_model(model_name).parameters())
    sizes = [sum(c[r].numel() if r < len(c) else 0 for c in (torch.chunk(p, d, dim=0) for p in params))
             for r in range(d)]
    assert [zt.layout_bytes(model_name, d, "fsdp2", r)["parameters"] for r in range(d)] == [4 * x for x in sizes]
    assert len(set(sizes)) > 1  # uneven: the first ranks hold a row more
    # when d divides every size the layout is the calculator's Ψ/d
    table = ch.predicted_table(model_name, [1, 2]).set_index(["degree", "variant"])
    for part in ("parameters", "gradients"):
        assert (table[part] == table[f"layout_{part}"]).all(), part
    with pytest.raises(ValueError, match="rank=3 must be in 0..2"):
        zt.layout_bytes(model_name, 3, "zero3", 3)


def test_padded_params():
    spec = get_spec(MODEL)
    assert zt.padded_params(spec, 2, "zero3") == (spec.n_params(), zt.root_params(spec))
    assert zt.padded_params(spec, 3, "ddp") == (spec.n_params(), zt.root_params(spec))
    psi, root = zt.padded_params(spec, 3, "zero3")
    assert psi % 3 == 0 and root % 3 == 0 and 0 < psi - spec.n_params() <= 2 * (spec.n_layers + 1)
    psi_f, _ = zt.padded_params(spec, 3, "fsdp2")
    assert psi_f > psi


def test_chapter_rank_passes_the_users_batch_to_the_memory_runs(monkeypatch):
    """The field case: chapter 04 at world_size=3 with global_batch_size=6 failed in the memory measurement
    (it ran with its own default batch of 8). Every training argument now reaches both parts."""
    seen = {}
    monkeypatch.setattr(ch, "run_rank", lambda ctx, runs=None, **kw: seen.setdefault("runs", kw) and [])
    monkeypatch.setattr(ch, "memory_rank", lambda ctx, degrees, variants, **kw: seen.setdefault("memory", kw))
    ch.chapter_rank(None, model="lab-tiny-gpt", steps=1, global_batch_size=6, seq_len=16, seed=3)
    assert seen["memory"] == {"model": "lab-tiny-gpt", "global_batch_size": 6, "seq_len": 16, "seed": 3}


def test_check_chapter_refuses_bad_parameters_before_any_launch():
    with pytest.raises(ValueError, match=r"chapter 04 needs world_size >= 2, got world_size=1"):
        ch.check_chapter(world_size=1)
    with pytest.raises(ValueError, match=r"world_size=3 does not divide global_batch_size=8.*multiple of world_size=3"):
        ch.check_chapter(world_size=3, global_batch_size=8)
    assert ch.check_chapter(world_size=3)["global_batch_size"] == 12  # a batch the user did not set adapts
    with pytest.raises(ValueError, match=r"steps=0"):
        ch.check_chapter(world_size=2, steps=0)
    with pytest.raises(ValueError, match=r"seq_len=500 exceeds"):
        ch.check_chapter(world_size=2, seq_len=500)
    assert ch.check_chapter(world_size=3, global_batch_size=6)["local_batch_size"] == 2


@pytest.mark.slow
def test_three_ranks_uneven_shards_and_the_users_batch():
    """Chapter 04's launch at world_size=3, global_batch_size=6: trains, measures memory at every degree with
    the user's batch, and every rank's live bytes equal layout_bytes; the ring model of the logged calls
    equals the formula with padded Ψ."""
    res = launch(ch.chapter_rank, 3, model=MODEL, steps=1, global_batch_size=6, seq_len=SEQ, timeout_s=300)
    for rank in range(3):
        for row in res[rank]["memory"]:
            want = zt.layout_bytes(MODEL, row["degree"], row["variant"], rank % row["degree"])
            assert {k: row[k] for k in want} == want, (rank, row["degree"], row["variant"])
    table = ch.comm_table(res, MODEL)
    assert (table[ch.RING] - table[ch.PREDICTED]).abs().max() <= 1e-9 * table[ch.PREDICTED].max()


MY_MODULES = ["labkit.parallel.data", "labkit.parallel.data.naive", "labkit.parallel.data.bucketed",
              "labkit.parallel.data.torch_native", "labkit.parallel.zero", "labkit.parallel.zero.units",
              "labkit.parallel.zero.wrapper", "labkit.parallel.zero.fsdp2",
              "labkit.parallel.zero.optimizer", "labkit.theory.data", "labkit.theory.zero",
              "labkit.experiments.data", "labkit.experiments.zero", "labkit.chapters.ch03_data_parallel",
              "labkit.chapters.ch04_zero_fsdp", "labkit.runtime.training", "labkit.experiments.common",
              "labkit.chapters.common",
              "labkit.parallel.tensor.primitives", "labkit.parallel.tensor.layers", "labkit.parallel.tensor.blocks",
              "labkit.parallel.tensor.model", "labkit.parallel.tensor.dtensor", "labkit.theory.tensor",
              "labkit.experiments.tensor", "labkit.chapters.ch05_tensor_parallel",
              "labkit.parallel.pipeline.stage", "labkit.parallel.pipeline.p2p", "labkit.parallel.pipeline.runner",
              "labkit.parallel.pipeline.torch_native", "labkit.experiments.pipeline", "labkit.theory.pipeline",
              "labkit.chapters.ch06_pipeline_parallel", "labkit.parallel.composed", "labkit.theory.simulate",
              "labkit.theory.composed", "labkit.experiments.composed", "labkit.chapters.ch09_composing_meshes"]


@pytest.mark.parametrize("module", MY_MODULES)
def test_public_functions_that_raise_say_so(module):
    """A public function whose body validates its input (raise ValueError, or a labkit.checks helper) says
    what it raises in its docstring (field report: zt.predicted_comm_bytes had no Raises section)."""
    import ast
    import importlib
    import inspect
    import re

    mod = importlib.import_module(module)
    src = inspect.getsource(mod)
    validates = re.compile(r"raise ValueError|positive_int\(|positive_float\(|check_divides\(|check_choice\(|"
                           r"check_tp\(|check_schedule_args\(|check_job\(|check_world_size\(|check_batch\(")
    missing = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
            doc = ast.get_docstring(node) or ""
            if validates.search(ast.get_source_segment(src, node)) and not re.search(r"[Rr]ais|ValueError", doc):
                missing.append(f"{node.name} (line {node.lineno})")
    assert not missing, f"{module}: document the errors of {missing}"


def test_check_fsdp_devices_without_a_group():
    model = build_model(MODEL)
    zero.check_fsdp_devices(model, "cpu", "gloo")  # fine
    with pytest.raises(ValueError, match="backend='nccl'"):
        zero.check_fsdp_devices(model, "cpu", "nccl")
    with pytest.raises(ValueError, match="device_type='cuda' does not match backend='gloo'"):
        zero.check_fsdp_devices(model, "cuda", "gloo")
    with pytest.raises(ValueError, match=r"parameter 'embed.weight' is on meta"):
        zero.check_fsdp_devices(_meta_model(), "cpu", "gloo")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fsdp2_gloo_with_cuda_parameters_raises():
    """The field case exactly: a gloo group and parameters on CUDA."""
    with pytest.raises(ValueError, match="is on cuda"):
        zero.check_fsdp_devices(build_model(MODEL, device="cuda"), "cpu", "gloo")

