"""Chapter 01's sentences follow the numbers: the large-model verdict flips with the model, and the FSDP2
shards are even on 2 ranks and uneven on 3 (real runs)."""

import pytest

from labkit.chapters import ch01_memory_budgets as ch


def test_device_follows_emulate_unless_given():
    assert ch.device_for("dgx-a100", None) == "a100-80gb"
    assert ch.device_for(None, None) == "h100-80gb"
    assert ch.device_for("dgx-a100", "h100-80gb") == "h100-80gb"


def test_large_findings_flip_with_the_model():
    big70 = ch.large_findings(ch.large_training_rows("llama-3-70b", "h100-80gb"), "h100-80gb")
    big8 = ch.large_findings(ch.large_training_rows("llama-3-8b", "h100-80gb"), "h100-80gb")
    assert "does not fit" in big70 and "still fits" not in big70
    assert "still fits" in big8 and "7 of 7 layouts fit" in big8


@pytest.mark.slow
@pytest.mark.parametrize("world_size, even", [(2, True), (3, False)])
def test_fsdp_sentence_flips_between_even_and_uneven_shards(world_size, even):
    run = ch.measure(world_size, "lab-tiny-llama", micro_batch_size=1, seq_len=16, attention="sdpa", timeout_s=240)
    f = run["findings"]
    assert f["even"] is even
    assert ("Every rank holds the same FSDP2 bytes" in f["sentence"]) is even
    assert ("The ranks hold different FSDP2 bytes" in f["sentence"]) is (not even)
    assert abs(f["saving_measured"] - f["saving_predicted"]) < 1e-9
