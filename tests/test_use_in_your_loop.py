"""docs/use-in-your-loop.md is executed: every ```python block, on 2 gloo ranks (one launch). The first block is
the setup; each later block runs in a fresh copy of the setup's names, so a block cannot lean on another's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from labkit import launch

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "use-in-your-loop.md"


def blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), flags=re.S)


def run_blocks(ctx, sources: list[str]) -> list[str | None]:
    """Rank function: exec the setup, then each block in a copy of its names; None per block that ran, else
    its traceback."""
    import traceback

    setup = {"__name__": "use_in_your_loop"}
    exec(compile(sources[0], "use-in-your-loop.md[0]", "exec"), setup)  # noqa: S102 - the guide's own code
    out = []
    for i, src in enumerate(sources[1:], start=1):
        ns = dict(setup)
        try:
            exec(compile(src, f"use-in-your-loop.md[{i}]", "exec"), ns)  # noqa: S102
            out.append(None)
        except Exception:  # noqa: BLE001 - reported per block
            out.append(traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def results():
    return launch(run_blocks, 2, blocks(), timeout_s=300)


def test_the_guide_has_a_block_per_strategy():
    text = "\n".join(blocks())
    for name in ("DataParallelNaive", "DataParallelBucket", "ShardedOptimizer", "ZeroRedundancyOptimizer",
                 "ZeroDataParallel", "fully_shard", "clip_grad_norm_", "MixedPrecisionPolicy", "no_sync"):
        assert name in text, name


def test_every_block_runs_on_two_ranks(results):
    failures = [f"block {i + 1} on rank {r}:\n{tb}" for r, per_rank in enumerate(results)
                for i, tb in enumerate(per_rank) if tb is not None]
    assert not failures, "\n".join(failures)
    assert len(results[0]) == len(blocks()) - 1
