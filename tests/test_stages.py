"""Uneven pipeline stages, schedules' in-flight counts, Megatron's activation formula, the fast peak the planner
uses, the program-visible capacity, and bounded bad input — each against an independent source: the published
splits (Llama 3, BLOOM), Megatron-LM's formulas written out here, the calculator's own full computation."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from labkit.cli import main as cli_main
from labkit.theory import memory as m
from labkit.theory import planner
from labkit.theory.spec import ModelSpec, get_spec

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------------------------------
# the split
# ------------------------------------------------------------------------------------------------------
def test_published_uneven_splits_are_derived():
    # Llama 3 405B: 126 layers on 16 stages, "one Transformer layer" removed from the first and the last stage
    # (Llama Team 2024, Sec. 3.3.2): 7 + 14 x 8 + 7
    assert m.split_layers(126, 16) == (7,) + (8,) * 14 + (7,)
    # BLOOM-176B: 70 layers on 12 stages with DeepSpeed's 'type:transformer|embedding' partition (the two
    # embeddings count as layers: 72 units, 6 per stage): 5 + 10 x 6 + 5 (bigscience tr11-176B-ml.slurm)
    assert m.split_layers(70, 12) == (5,) + (6,) * 10 + (5,)
    # pp divides n_layers: the even split (Narayanan et al. 2021)
    assert m.split_layers(80, 8) == (10,) * 8
    assert m.format_split(m.split_layers(126, 16)) == "7,8x14,7"


def test_megatron_first_and_last_stage_options():
    # --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers: the rest split evenly
    assert m.split_layers(126, 16, first=7, last=7) == (7,) + (8,) * 14 + (7,)
    assert m.split_layers(80, 4, first=17) == (17, 21, 21, 21)
    with pytest.raises(ValueError, match="other 2 stages hold 65 layers, which they cannot split evenly"):
        m.split_layers(80, 4, first=10, last=5)


@given(st.integers(1, 200), st.integers(1, 64), st.sampled_from([1, 2, 3, 4]))
def test_every_derived_split_is_valid_or_refused(n, pp, vpp):
    try:
        split = m.split_layers(n, pp, vpp)
    except ValueError as e:
        assert pp * vpp > n and "exceeds n_layers" in str(e)
        return
    assert len(split) == pp and sum(split) == n and min(split) >= vpp
    assert max(split) - min(split) <= 2  # balanced: the edges at most one layer lighter, the middle one heavier
    if n % pp == 0:
        assert set(split) == {n // pp}


def test_chunks_and_layer_ids():
    # interleaved, even: chunk c of rank i is the (c*pp + i)-th block (Narayanan et al. 2021, Sec. 2.2.2)
    assert m.stage_layers(8, 2, 2, 0) == [0, 1, 4, 5]
    # uneven: rank 0 holds 7 layers in chunks of 4 and 3, rank 1 8 in 4 + 4; model order 0:4 | 4:8 | 8:11 | 11:15
    split = (7, 8)
    assert m.chunk_split(split, 2) == (4, 4, 3, 4)
    assert m.stage_layers(15, 2, 2, 0, split) == [0, 1, 2, 3, 8, 9, 10]
    assert m.stage_layers(15, 2, 2, 1, split) == [4, 5, 6, 7, 11, 12, 13, 14]
    every = sorted(x for k in range(2) for x in m.stage_layers(15, 2, 2, k, split))
    assert every == list(range(15))


def test_uneven_stages_in_the_calculator_heaviest_stage_decides():
    spec = get_spec("llama-3.1-405b")
    par = m.ParallelConfig(dp=64, tp=8, pp=16, zero=1, sequence_parallel=True)  # no split given: derived
    train = m.TrainConfig(seq_len=8192, n_microbatches=32, recompute="full", convention="megatron")
    est = m.train_memory(spec, par, train, device="h100-80gb")
    assert est.assumptions["layers_per_stage"] == (7,) + (8,) * 14 + (7,)
    assert len(est.per_stage) == 16 and est.total_bytes == max(est.per_stage) == est.per_stage[est.stage]
    # stage 1 holds 8 layers and 15 micro-batches in flight; stage 0 holds 7 and 16 plus the embedding: the
    # model states of one more layer outweigh one more micro-batch of the first stage's inputs here
    assert est.stage == 1 and est.details["layers"] == 8
    given = m.train_memory(spec, m.ParallelConfig(dp=64, tp=8, pp=16, zero=1, sequence_parallel=True,
                                                  layers_per_stage=(7,) + (8,) * 14 + (7,)), train,
                           device="h100-80gb")
    assert given.total_bytes == est.total_bytes and given.assumptions["layers_per_stage_given"]


def test_the_field_case_pp_not_dividing_layers_is_accepted():
    # a model whose layer count the pipeline degree does not divide (a published run did this): accepted
    from labkit.theory.mesh import ParallelDims

    ParallelDims(16, pp=16).check(get_spec("llama-3.1-405b"))
    est = m.estimate("train", model="llama-3-70b", pp=3, seq_len=1024, n_microbatches=3)
    assert est.assumptions["layers_per_stage"] == (26, 28, 26)  # 82 units: 27 + 28 + 27, one fewer on each edge


# ------------------------------------------------------------------------------------------------------
# in flight, and the planner's fast peak equals the calculator's
# ------------------------------------------------------------------------------------------------------
def test_zb_h1_holds_what_1f1b_holds():
    # Qi et al. 2023, Sec. 3.1: ZB-H1 keeps 1F1B's peak memory
    for p, mb in [(4, 8), (8, 8), (16, 32)]:
        for s in range(p):
            assert m.in_flight_microbatches("zb-h1", p, mb, 1, s) == m.in_flight_microbatches("1f1b", p, mb, 1, s)


@st.composite
def pipelines(draw):
    name = draw(st.sampled_from(["llama-3-8b", "lab-small-llama", "mixtral-8x7b", "gpt-18.4b"]))
    spec = get_spec(name)
    pp = draw(st.integers(1, min(12, spec.n_layers)))
    split = None
    if draw(st.booleans()) and pp > 1:
        cuts = sorted(draw(st.lists(st.integers(1, spec.n_layers - 1), min_size=pp - 1, max_size=pp - 1,
                                    unique=True)))
        split = tuple(b - a for a, b in zip([0, *cuts], [*cuts, spec.n_layers], strict=True))
    tp = draw(st.sampled_from([1, 2]))
    par = m.ParallelConfig(dp=draw(st.sampled_from([1, 2, 4])), tp=tp, pp=pp, zero=draw(st.integers(0, 3)),
                           sequence_parallel=tp > 1 and draw(st.booleans()), layers_per_stage=split)
    mb = draw(st.sampled_from([pp, 2 * pp, 3 * pp]))
    train = m.TrainConfig(seq_len=draw(st.sampled_from([128, 512])), n_microbatches=mb,
                          recompute=draw(st.sampled_from(m.RECOMPUTE)),
                          convention=draw(st.sampled_from(["megatron", "zero", "deepspeed"])),
                          activation_model=draw(st.sampled_from(["lab", "megatron"])) if not spec.is_moe else "lab")
    smallest = min(par.split(spec.n_layers))
    scheds = [("1f1b", 1), ("zb-h1", 1), ("gpipe", 1)] if pp > 1 else [("1f1b", 1)]
    if pp > 1 and smallest >= 2 and mb % pp == 0:
        scheds += [("interleaved", v) for v in range(2, min(4, smallest) + 1)]
    return spec, par, train, scheds


@FAST
@given(pipelines())
def test_train_peaks_equals_train_memory(case):
    from dataclasses import replace

    spec, par, train, scheds = case
    spec = m.padded_spec(spec, par.tp)
    fast = m.train_peaks(spec, par, train, scheds, headroom=0.15, workspace_bytes=2**30)
    for (sched, v), (total, stage, n_local) in zip(scheds, fast, strict=True):
        full = m.train_memory(spec, replace(par, schedule=sched, vpp=v), train, headroom=0.15, workspace_bytes=2**30)
        assert (total, stage, n_local) == (full.total_bytes, full.stage, full.n_params_local), (sched, v)


# ------------------------------------------------------------------------------------------------------
# Megatron-LM's activation formula, written out here from theoretical_memory_usage.py
# ------------------------------------------------------------------------------------------------------
def test_megatron_activations_are_megatrons_formula():
    spec = get_spec("gpt-3-175b")
    s, b, h, f, t, p, v = 2048, 1, 12288, 49152, 8, 8, 51200
    train = m.TrainConfig(seq_len=s, micro_batch_size=b, recompute="selective", activation_model="megatron",
                          n_microbatches=16)
    par = m.ParallelConfig(tp=t, pp=p, sequence_parallel=True)
    per_layer = s * b * h * (18 + 4 * f / h) / t  # compute_activation_memory, one layer, divided by tp
    assert 18 + 4 * f / h == 34  # = Korthikanti et al. 2022, Table 2, selective recompute with SP: 34 sbh / t
    assert m.activation_bytes_per_layer(spec, train, par) == per_layer
    est = m.train_memory(spec, par, train)
    first = m.train_memory(spec, par, train, stage=0)
    # first stage: L/p layers x p micro-batches in flight, + input ids 8sb and embedding dropout sbh per micro-batch
    # in flight, all divided by tp; the vocabulary padded to 51200 for tp = 8
    assert first.categories["activations"] == (96 // p) * p * per_layer + p * (8 * s * b + s * b * h) / t
    assert est.assumptions["vocab_size"] == v
    last = m.train_memory(spec, par, train, stage=p - 1)
    assert last.categories["activations"] == (96 // p) * 1 * per_layer + 4 * s * b * h * (1 + v / h) / t


# ------------------------------------------------------------------------------------------------------
# program-visible capacity
# ------------------------------------------------------------------------------------------------------
def test_fits_uses_the_program_visible_capacity():
    dev = m.get_device("h100-80gb")
    # deviceQuery on an H100 80GB HBM3: "81106 MBytes (85045477376 bytes)" (data/hardware.yaml's source)
    assert m.usable_bytes(dev) == 85045477376 < dev["memory_bytes"] == 80 * 2**30
    est = m.train_memory("llama-3-8b", device="h100-80gb")
    assert est.device_bytes == 85045477376 and "79.2 GiB usable" in est.verdict()
    # a budget between 79.2 and 80 GiB is refused now (it used to be accepted against the datasheet's 80 GiB)
    assert m.usable_bytes(m.get_device("mi300x-192gb")) == m.get_device("mi300x-192gb")["memory_bytes"]


# ------------------------------------------------------------------------------------------------------
# bad input: bounded time, ValueError naming the value; the CLI one line, exit 2
# ------------------------------------------------------------------------------------------------------
HUGE = 10**18


@pytest.mark.parametrize("call, match", [
    (lambda: planner.plan("llama-3-70b", gpus=HUGE, global_batch_size=64), "gpus=1000000000000000000 is out of"),
    (lambda: planner.plan("llama-3-70b", gpus=64, global_batch_size=64, seq_len=HUGE), "seq_len=.* is out of range"),
    (lambda: planner.plan("llama-3-70b", gpus=64, global_batch_size=HUGE), "global_batch_size=.* is out of range"),
    (lambda: planner.plan("llama-3-70b", gpus=64, global_batch_size=64, micro_batch_sizes=(HUGE,)), "out of range"),
    (lambda: planner.plan("llama-3-70b", gpus=64, global_batch_size=64, mfu=float("nan")), "mfu=nan"),
    (lambda: planner.plan("llama-3-70b", gpus=64, global_batch_size=64, mfu=-0.3), "mfu=-0.3"),
    (lambda: planner.plan("llama-3-70b", gpus=64, global_batch_size=64, headroom=float("nan")), "headroom=nan"),
    (lambda: planner.plan("llama-3-70b", gpus=64, global_batch_size=64, nics_per_node=0), "nics_per_node=0"),
    (lambda: planner.plan("llama-3-70b", gpus=64, global_batch_size=64, layers_per_stage=(40, 41)),
     "sums to 81, not n_layers=80"),
    (lambda: planner.plan("llama-3-70b", gpus=64, global_batch_size=64, schedules=("1f1b", "zigzag")),
     "schedule='zigzag' is not valid"),
    (lambda: planner.plan(ModelSpec(n_layers=HUGE, hidden_size=64, n_heads=4, ffn_hidden_size=64, vocab_size=64),
                          gpus=8, global_batch_size=8), "n_layers=1000000000000000000 is out of range"),
    (lambda: planner.plan(ModelSpec(n_layers=2, hidden_size=HUGE, n_heads=1, ffn_hidden_size=64, vocab_size=64),
                          gpus=8, global_batch_size=8), "hidden_size=.* is out of range"),
    (lambda: m.train_memory("llama-3-8b", m.ParallelConfig(cp=3), m.TrainConfig(seq_len=HUGE)), "seq_len=.* out"),
    (lambda: m.train_memory("llama-3-8b", m.ParallelConfig(tp=HUGE)), "tp=1000000000000000000 is out of range"),
    (lambda: m.ParallelConfig(dp=2**19, tp=2**19), r"dp\*tp\*pp\*cp = .* ranks is out of range"),
    (lambda: m.infer_memory("llama-3-8b", infer=m.InferConfig(prompt_len=HUGE)), "prompt_len=.* is out of range"),
    (lambda: m.train_memory(ModelSpec(n_layers=3, hidden_size=2**40, n_heads=1, ffn_hidden_size=4, vocab_size=4)),
     "hidden_size=.* is out of range"),
    (lambda: m.split_layers(HUGE, 7), "n_layers=.* is beyond"),
    (lambda: m.check_split((1,) * 5, 6, 5), "sums to 5, not n_layers=6"),
])
def test_absurd_input_is_refused_fast(call, match):
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        call()
    assert time.perf_counter() - t0 < 0.5


@pytest.mark.parametrize("argv, needle", [
    (["plan", "--model", "llama-3-70b", "--gpus", str(HUGE), "--global-batch", "64"], "gpus=1000000000000000000"),
    (["plan", "--model", "llama-3-70b", "--gpus", "64", "--global-batch", "64", "--seq", str(HUGE)], "seq_len="),
    (["plan", "--model", "llama-3-70b", "--gpus", "64", "--global-batch", "64", "--mfu", "nan"], "mfu=nan"),
    (["plan", "--model", "llama-3-70b", "--gpus", "64", "--global-batch", "64", "--stage-layers", "40,41"],
     "sums to 81"),
    (["plan", "--gpus", "64"], "--model, --global-batch are required"),
    (["memory", "--model", "llama-3.1-405b", "--pp", "16", "--stage-layers", "7,8,7"], "has 3 entries but pp=16"),
    (["memory", "--model", "llama-3-8b", "--seq", str(HUGE)], "seq_len=1000000000000000000 is out of range"),
    (["memory", "--model", "llama-3-8b", "--tp", str(HUGE)], "tp=1000000000000000000 is out of range"),
    (["memory", "--model", "llama-3-8b", "--pp", "4", "--first-stage-layers", "9"], "cannot split evenly"),
])
def test_cli_absurd_input_one_line_exit_2(capsys, argv, needle):
    t0 = time.perf_counter()
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
    assert time.perf_counter() - t0 < 1.0


def test_memory_cli_pads_the_vocabulary_and_says_so(capsys):
    # GPT-3's vocabulary (50257 = 29 x 1733) is padded for tp=8 as the planner pads it, not refused
    assert cli_main(["memory", "--model", "gpt-3-175b", "--tp", "8", "--pp", "8", "--sp", "--seq", "2048"]) == 0
    out = capsys.readouterr().out
    assert "vocabulary padded 50257 -> 51200 for tp=8" in out
    assert cli_main(["memory", "--model", "llama-3.1-405b", "--pp", "16", "--tp", "8", "--sp", "--seq", "1024"]) == 0
    assert "stage split: 7,8x14,7 layers per pipeline stage (derived" in capsys.readouterr().out


def test_theory_reads_published_runs_without_pandas_or_torch():
    code = ("import sys, labkit.theory.published as p; rows = p.load_training_runs(); "
            "assert len(rows) >= 6 and 'tflops_per_gpu' in rows[0]; "
            "assert 'pandas' not in sys.modules and 'torch' not in sys.modules, 'pandas/torch imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
