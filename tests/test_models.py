"""The lab's model and training harness (single process)."""

import math

import pytest
import torch

from labkit import models
from labkit.theory.spec import get_spec

LLAMA = get_spec("lab-tiny-llama")
GPT = get_spec("lab-tiny-gpt")


@pytest.mark.parametrize("spec", [LLAMA, GPT], ids=["llama", "gpt"])
def test_parameter_count_matches_spec_and_shapes(spec):
    m = models.build_model(spec)
    assert sum(p.numel() for p in m.parameters()) == spec.n_params()
    x = torch.randint(spec.vocab_size, (2, 16))
    assert m(x).shape == (2, 16, spec.vocab_size)
    assert (m.lm_head is None) == spec.tied_embeddings and (m.pos_embed is None) == (spec.position == "rope")


def test_llama_flavour_pieces():
    m = models.build_model(LLAMA)
    blk = m.layers[0]
    assert isinstance(blk.attn_norm, models.RMSNorm) and isinstance(blk.mlp, models.SwiGLU)
    assert blk.attn.wk.out_features == LLAMA.n_kv_heads * LLAMA.head_dim < blk.attn.wq.out_features  # GQA
    g = models.build_model(GPT).layers[0]
    assert isinstance(g.attn_norm, torch.nn.LayerNorm) and isinstance(g.mlp, models.GeluMLP)


def test_deterministic_init_depends_only_on_seed():
    a, b, c = models.build_model(LLAMA, seed=1), models.build_model(LLAMA, seed=1), models.build_model(LLAMA, seed=2)
    for (n, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q), n
        if "norm" not in n and not n.endswith("bias"):
            assert not torch.equal(p, r), n
    # output projections get the 1/sqrt(2L) scaled init
    std_wo = a.layers[0].attn.wo.weight.std().item()
    assert std_wo == pytest.approx(0.02 / math.sqrt(2 * LLAMA.n_layers), rel=0.15)


def test_eager_and_sdpa_attention_agree_and_positions_default():
    x = torch.randint(LLAMA.vocab_size, (2, 24))
    a, b = models.build_model(LLAMA), models.build_model(LLAMA, attention="eager")
    torch.testing.assert_close(a(x), b(x), **models.TOLERANCES[torch.float32])
    torch.testing.assert_close(a(x), a(x, positions=torch.arange(24)), rtol=0, atol=0)
    with pytest.raises(ValueError, match="attention='flash2'"):
        models.build_model(LLAMA, attention="flash2")
    with pytest.raises(ValueError, match="exceeds model .*max_seq_len"):
        a(torch.zeros(1, LLAMA.max_seq_len + 1, dtype=torch.long))


def test_causality():
    m = models.build_model(LLAMA)
    x = torch.randint(LLAMA.vocab_size, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % LLAMA.vocab_size
    torch.testing.assert_close(m(x)[:, :8], m(y)[:, :8], rtol=0, atol=0)


def test_synthetic_data_is_deterministic_and_learnable():
    d = models.SyntheticLM(256, 32, seed=0)
    t1, g1 = d.batch(3, 8)
    t2, g2 = models.SyntheticLM(256, 32, seed=0).batch(3, 8)
    assert torch.equal(t1, t2) and torch.equal(g1, g2)
    assert torch.equal(t1[:, 1:], g1[:, :-1])  # targets are the next tokens
    assert not torch.equal(d.batch(4, 8)[0], t1)
    # every transition is one of the chain's successors
    ok = (d.successors[t1.reshape(-1)] == g1.reshape(-1, 1)).any(dim=1)
    assert ok.all()
    assert 0 < d.entropy_rate() < math.log(4)
    res = models.train_reference(LLAMA, steps=25, global_batch_size=8, seq_len=32, lr=3e-3)
    assert res["losses"][0] == pytest.approx(math.log(256), rel=0.05)
    assert res["losses"][-1] < res["losses"][0] - 1.0, res["losses"]


def test_accumulation_equals_full_batch():
    full = models.train_reference(GPT, steps=2, global_batch_size=8, seq_len=16, return_grads=True)
    acc = models.train_reference(GPT, steps=2, global_batch_size=8, seq_len=16, n_microbatches=4, return_grads=True)
    for k, v in full["state_dict"].items():
        torch.testing.assert_close(acc["state_dict"][k], v, **models.TOLERANCES[torch.float32])
    with pytest.raises(ValueError, match="n_microbatches=3 does not divide global_batch_size=8"):
        models.train_reference(GPT, steps=1, global_batch_size=8, seq_len=16, n_microbatches=3)


def test_shard():
    x = torch.arange(12).reshape(6, 2)
    assert models.shard(x, 1, 3).tolist() == [[4, 5], [6, 7]]
    with pytest.raises(ValueError, match="n=4 does not divide"):
        models.shard(x, 0, 4)
    with pytest.raises(ValueError, match="index=3"):
        models.shard(x, 3, 3)


def test_flops_and_mfu():
    spec = LLAMA
    n = spec.n_params() - spec.vocab_size * spec.hidden_size  # minus the input embedding lookup
    expect = 6 * n + 12 * spec.n_layers * spec.n_heads * spec.head_dim * 64
    assert models.flops_per_token(spec, 64) == expect
    assert models.flops_per_token(spec, 64, training=False) == pytest.approx(expect / 3)
    assert models.mfu(1000.0, spec, 64, peak_flops=expect * 2000.0) == pytest.approx(0.5)
    peak = models.measure_matmul_peak(n=128, repeats=2)
    assert peak > 1e6  # measured FLOP/s: a real number, not a datasheet
    with pytest.raises(ValueError, match="peak_flops"):
        models.mfu(1.0, spec, 64, peak_flops=0)


def test_chapter00_parameter_check():
    from labkit.chapters.ch00_getting_started import check_chapter

    check_chapter(world_size=2, emulate=None, my_prediction=None, work_ms=40.0, steps=3, timeout_s=120.0)
    with pytest.raises(ValueError, match="chapter 00 needs world_size >= 2, got world_size=1"):
        check_chapter(world_size=1, emulate=None, my_prediction=None, work_ms=40.0, steps=3, timeout_s=120.0)
    with pytest.raises(ValueError, match="work_ms=0"):
        check_chapter(world_size=2, emulate=None, my_prediction=None, work_ms=0, steps=3, timeout_s=120.0)
    with pytest.raises(ValueError, match="steps=0"):
        check_chapter(world_size=2, emulate=None, my_prediction=None, work_ms=40.0, steps=0, timeout_s=120.0)
