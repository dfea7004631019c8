"""Chapter 01 (memory budgets): its parameter check and the predicted-only tables it shows.

The rank function it launches is :func:`labkit.experiments.memory.measure_training_rank` (one AdamW step alone,
under DDP and under FSDP2, measured beside the prediction); every number it predicts comes from
:mod:`labkit.theory.memory`.
"""

from __future__ import annotations

import pandas as pd

from labkit.chapters.common import check_world_size
from labkit.checks import positive_float
from labkit.experiments.memory import WRAPS, check_training_run
from labkit.theory import memory as mem
from labkit.theory.spec import get_spec

KiB = 1024
#: the layouts the launch measures, in order: one rank alone (the reference), DDP, FSDP2
LAYOUTS = WRAPS
#: the budget's categories a training table shows (kv_cache is the serving budget's)
TRAIN_COLUMNS = ("parameters", "gradients", "optimizer", "activations", "temporary", "communication", "workspace",
                 "headroom")
#: Llama-3-70B training layouts on 64-512 GPUs (section 4)
LARGE_LAYOUTS = (dict(dp=64, zero=3),
                 dict(dp=8, tp=8, zero=1, sequence_parallel=True),
                 dict(dp=4, tp=8, pp=2, zero=1, sequence_parallel=True),
                 dict(dp=16, tp=8, zero=1, sequence_parallel=True),
                 dict(dp=16, tp=8, pp=2, zero=1, sequence_parallel=True),
                 dict(dp=64, tp=8, zero=1, sequence_parallel=True),
                 dict(dp=16, tp=8, pp=4, zero=1, sequence_parallel=True))
#: the training step of section 4: sequence 8192, micro-batch 1, 16 micro-batches, selective recompute, flash
LARGE_TRAIN = dict(micro_batch_size=1, seq_len=8192, n_microbatches=16, recompute="selective", attention="flash")


def check_chapter(*, world_size, model: str, micro_batch_size, seq_len, attention: str, big_model: str,
                  device: str, timeout_s) -> dict:
    """Validate chapter 01's parameters before any launch; returns
    :func:`labkit.experiments.memory.check_training_run`'s dict (``summary``: the host memory the launch needs,
    predicted, beside this machine's).

    Raises ValueError naming the value and the fix: world_size >= 2 (DDP replicates and FSDP2 shards over the
    ranks: one rank shards nothing); ``big_model`` a preset and ``device`` a device of data/hardware.yaml (the
    large-model tables); timeout_s > 0; and whatever :func:`check_training_run` refuses for the launch (an
    unknown or mixture-of-experts ``model`` — its activations are only estimated, so measured cannot equal
    predicted —, micro_batch_size < 1, seq_len beyond the model's max_seq_len, an unknown ``attention``, or a
    model this machine's memory cannot hold on ``world_size`` ranks)."""
    world_size = check_world_size("01", world_size,
                                  why="DDP replicates and FSDP2 shards over the ranks: one rank shards nothing")
    for name, check, value in (("big_model", get_spec, big_model), ("device", mem.get_device, device)):
        try:
            check(value)
        except ValueError as e:
            raise ValueError(f"{name}={value!r} (the large-model tables): {e}") from None
    positive_float("timeout_s", timeout_s)
    return check_training_run(model, world_size, micro_batch_size=micro_batch_size, seq_len=seq_len,
                              attention=attention, wraps=LAYOUTS, exact_activations=True)


def pending_layouts(world_size: int) -> dict[str, mem.ParallelConfig]:
    """The layouts later chapters measure (ZeRO-1 and ZeRO-2 over ``world_size`` ranks, TP=2, TP=2 with sequence
    parallelism), by label, for the predicted-only table of section 2."""
    out = {f"ZeRO-{z}, dp={world_size}": mem.ParallelConfig(dp=world_size, zero=z) for z in (1, 2)}
    out["TP=2"] = mem.ParallelConfig(tp=2)
    out[f"TP=2 + SP, dp={world_size // 2 or 1}"] = mem.ParallelConfig(tp=2, dp=max(1, world_size // 2),
                                                                      sequence_parallel=True)
    return out


def predicted_only_table(spec, train: mem.TrainConfig, world_size: int) -> pd.DataFrame:
    """Model states and activations of :func:`pending_layouts` for ``spec`` and ``train``, KiB per rank
    (predicted, no headroom or workspace), one row per layout."""
    pred = pd.DataFrame({k: mem.train_memory(spec, v, train, headroom=0.0, workspace_bytes=0).categories
                         for k, v in pending_layouts(world_size).items()}).T
    pred = pred[["parameters", "gradients", "optimizer", "activations"]]
    return (pred / KiB).round(1).rename(columns=lambda c: f"{c} KiB (predicted)")


def large_training_rows(big_model: str, device: str) -> pd.DataFrame:
    """:func:`labkit.theory.memory.layout_rows` of ``big_model`` for :data:`LARGE_LAYOUTS` with
    :data:`LARGE_TRAIN` (bytes, predicted), plus a ``label`` per row ("64 GPUs: dp64 tp1 pp1 z3")."""
    big = pd.DataFrame(mem.layout_rows(big_model, LARGE_LAYOUTS, device=device, **LARGE_TRAIN))
    big["label"] = big.apply(lambda r: f"{r.world_size} GPUs: dp{r.dp} tp{r.tp} pp{r.pp} z{r.zero}", axis=1)
    return big


def large_training_table(big: pd.DataFrame, device: str) -> pd.DataFrame:
    """:func:`large_training_rows` as a table: every :data:`TRAIN_COLUMNS` category and the peak in GiB per GPU
    (predicted, 1 decimal), and whether it fits ``device``."""
    cols = list(TRAIN_COLUMNS)
    table = (big.set_index("label")[cols + ["total_bytes"]] / mem.GiB).round(1)
    table.columns = [f"{c} GiB (predicted)" for c in cols] + ["peak GiB (predicted)"]
    table[f"fits {device} (predicted)"] = big.set_index("label")["fits"]
    return table


def serving_table(big_model: str, device: str, *, tp: int = 8, batch: int = 32, prompt_len: int = 2048,
                  output_len: int = 512, weight_dtypes=("bf16", "int8", "int4")) -> pd.DataFrame:
    """Serving ``big_model`` with TP=``tp``: weights, KV cache and peak in GiB per GPU, whether it fits
    ``device`` and ``max_batch`` (the most concurrent sequences that still fit), one row per weight dtype — all
    predicted (:func:`labkit.theory.memory.serving_rows`)."""
    serve = pd.DataFrame(mem.serving_rows(big_model, [dict(batch=batch, prompt_len=prompt_len, output_len=output_len,
                                                           weight_dtype=w) for w in weight_dtypes],
                                          device=device, tp=tp))
    serve["weights GiB (predicted)"] = serve["parameters"] / mem.GiB
    serve["KV cache GiB (predicted)"] = serve["kv_cache"] / mem.GiB
    serve["peak GiB (predicted)"] = serve["total_bytes"] / mem.GiB
    serve = serve.rename(columns={"batch": "batch (sequences)", "fits": f"fits {device} (predicted)",
                                  "max_batch": "max_batch (predicted, sequences)"})
    return serve[["weight_dtype", "batch (sequences)", "weights GiB (predicted)", "KV cache GiB (predicted)",
                  "peak GiB (predicted)", f"fits {device} (predicted)", "max_batch (predicted, sequences)"]].round(2)
