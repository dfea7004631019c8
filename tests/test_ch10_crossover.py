"""Chapter 10's concurrency crossover: the sentences flip with the parameters that flip the outcome."""

import pandas as pd
import pytest

from labkit.chapters import ch10_serving as ch

H100 = {"gpus": 8, "gpu": "h100-80gb", "link": "nvlink4"}


def test_crossover_found_for_a_small_gqa_model_with_short_requests_and_not_for_13b_long_contexts():
    """The TP group's all-reduces priced as NCCL runs them (issue 26: below line rate, a per-call latency): at
    concurrency 1024 TP8 all-reduces 1024 x 4096 x 2 B = 8 MiB twice a layer, ~77 us each (~190 GB/s busbw)
    where line rate gave 33 us, so the replicas overtake it at 1024, not at 2048 as under line rate
    (test_crossover_follows_the_price_of_tps_all_reduces); at 8 sequences the ~36 us small-message latency of
    an 8-GPU all-reduce makes two TP4 groups beat one TP8."""
    short = ch.predict_crossover("llama-3-8b", prompt_len=128, output_len=128, **H100)
    long = ch.predict_crossover("llama-2-13b", prompt_len=1024, output_len=256, **H100)
    assert ch.crossover_point(short) == 1024 and ch.crossover_point(long) is None
    yes, no = " ".join(ch.crossover_findings(short, "llama-3-8b")), " ".join(ch.crossover_findings(long, "13b"))
    assert "from 1024 sequences in flight the 8 replicas give more" in yes and "up to concurrency 512" in yes, yes
    assert "no crossover in this sweep" in no and "every concurrency from 8 to 128" in no, no
    assert "above 128 the 8 replicas no longer fit" in no, no
    assert "Best TP degree by concurrency: 8: TP4" in yes and "1024: TP2" in yes and "2048: TP1" in yes, yes
    piv = short.pivot_table(index="concurrency", columns="tp", values="throughput_tok_s")
    assert piv.loc[512, 8] > piv.loc[512, 1] and piv.loc[1024, 1] > piv.loc[1024, 8]  # the sentence is the table


def _line_rate(op, nbytes, n, intra="nvlink4", inter=None, **kw):
    """A wrong model of the all-reduce: the ring at the link's line rate, no latency, no protocol (the
    pre-issue-26 pricing)."""
    from labkit.theory import costmodel as cm

    return 2 * (n - 1) / n * nbytes / (cm.get_link(intra).bandwidth_gbps * 1e9)


@pytest.mark.parametrize("wrong, crossover, best_at_8", [(_line_rate, 2048, "TP8"),
                                                         (lambda *a, **k: 0.0, None, "TP8")],
                         ids=["line-rate", "free-all-reduce"])
def test_crossover_follows_the_price_of_tps_all_reduces(monkeypatch, wrong, crossover, best_at_8):
    """The crossover is decided by what TP's all-reduces cost: priced at line rate it moves to 2048 (the old
    model's answer), free it never comes and TP8 stays best wherever the replicas fit — so the 1024 above
    comes from the calibrated collectives model, and a chapter pricing them any other way fails it."""
    from labkit.theory import costmodel as cm

    monkeypatch.setattr(cm, "collective_time", wrong)
    short = ch.predict_crossover("llama-3-8b", prompt_len=128, output_len=128, **H100)
    assert ch.crossover_point(short) == crossover
    assert f"Best TP degree by concurrency: 8: {best_at_8}," in ch.crossover_findings(short, "llama-3-8b")[1]


def test_crossover_comes_earlier_without_nvlink():
    nv = ch.predict_crossover("llama-3-8b", prompt_len=128, output_len=128, **H100)
    pcie = ch.predict_crossover("llama-3-8b", prompt_len=128, output_len=128, **{**H100, "link": "pcie5-x16"})
    assert ch.crossover_point(pcie) < ch.crossover_point(nv)


def _lab(ratios):
    rows = []
    for c, r in ratios.items():
        rows += [{"mode": "replicas", "concurrency": c, "throughput_tok_s": 100.0, "source": "measured"},
                 {"mode": "tp", "concurrency": c, "throughput_tok_s": 100.0 * r, "source": "measured"}]
    return pd.DataFrame(rows)


@pytest.mark.parametrize("ratios, want", [({2: 0.5, 4: 0.6}, "below replicas' at every concurrency"),
                                          ({2: 1.5, 4: 1.2}, "above replicas' at every concurrency"),
                                          ({2: 1.5, 4: 0.8}, "above replicas' at concurrency 2 only")])
def test_replicas_vs_tp_sentence_follows_the_table(ratios, want):
    text = ch.replicas_vs_tp(_lab(ratios), "measured")
    assert want in text and text.endswith("(measured)."), text


def test_check_chapter_takes_emulate_and_my_prediction(monkeypatch):
    import labkit.runtime.launcher

    monkeypatch.setattr(labkit.runtime.launcher, "launch", lambda *a, **k: pytest.fail("launched"))
    base = {"world_size": 2, "model": None, "n_requests": 16, "prompts": (16, 96), "output_len": 16, "ramp": None,
            "cancel_step": 4, "lose_at_step": 3, "big_model": "llama-3-8b", "gpus": 8, "gpu": None,
            "concurrency_gpu": 64, "lens_gpu": (128, 128)}
    got = ch.check_chapter(**base)
    assert (got["gpu"], got["link"]) == ("h100-80gb", "nvlink4")
    assert ch.check_chapter(**{**base, "emulate": "dgx-a100"})["gpu"] == "a100-80gb"
    assert ch.check_chapter(**{**base, "emulate": None})["link"] is None
    for bad, match in (({"my_prediction": "tp"}, "my_prediction='tp'"), ({"emulate": "nope"}, "nope"),
                       ({"emulate": "pcie-4090"}, "rtx-4090-24gb.*use one of"),
                       ({"prompts": (16,)}, "prompts"), ({"lens_gpu": (0, 5)}, "lens_gpu")):
        with pytest.raises(ValueError, match=match):
            ch.check_chapter(**{**base, **bad})


def test_emulated_crossover_run_is_labelled_and_tp_pays_its_all_reduces():
    emu = ch.run_emulated(2, model="lab-tiny-llama", emulate="dgx-h100")
    t = emu["emulated"]
    assert emu["label"] == "emulated (dgx-h100)" and set(t["source"]) == {"emulated (dgx-h100)"}
    assert len(t) == 2 * 3 and (t["throughput_tok_s"] > 0).all()
    assert "below replicas' at every concurrency" in ch.replicas_vs_tp(t, emu["label"])
    assert ch.run_emulated(2, model="lab-tiny-llama", emulate=None) is None
