"""Chapter 07 (context parallelism): its parameter check, the whole-model cases it runs, and the causal
imbalance verdict written from the numbers of its run.

The strategy is :mod:`labkit.parallel.context`, the predictions :mod:`labkit.theory.context`, the rank
functions it launches :func:`labkit.experiments.context.cp_parity_rank` and
:func:`labkit.experiments.context.cp_profile_rank`.
"""

from __future__ import annotations

from labkit.chapters.common import check_world_size
from labkit.checks import check_choice, positive_int
from labkit.theory.context import METHODS, predicted_pair_blocks


def check_chapter(*, world_size: int, seq_len: int, n_heads: int, head_dim: int, batch: int, repeats: int,
                  backend: str = "auto") -> None:
    """Validate chapter 07's parameters before anything is launched (the chapter's first code cell).

    Raises ValueError naming the value and the fix: world_size < 2 (context parallelism splits the sequence
    over ranks: one rank has nothing to exchange), 2·world_size not dividing seq_len (zigzag cuts the
    sequence into 2·cp chunks), world_size not dividing n_heads (Ulysses), sizes or repeats < 1, or a backend
    the machine cannot run (:func:`labkit.runtime.launcher.resolve_backend`)."""
    from labkit.runtime.launcher import resolve_backend

    world_size = check_world_size("07", world_size, why="context parallelism splits the sequence over ranks and "
                                  "exchanges keys and values between them")
    for name, value in (("seq_len", seq_len), ("n_heads", n_heads), ("head_dim", head_dim), ("batch", batch),
                        ("repeats", repeats)):
        positive_int(name, value)
    problems = []
    if seq_len % (2 * world_size):
        problems.append(f"2·cp={2 * world_size} does not divide seq_len={seq_len} (zigzag cuts the sequence into "
                        "2·cp chunks)")
    if n_heads % world_size:
        problems.append(f"cp={world_size} does not divide n_heads={n_heads} (Ulysses gives each rank n_heads/cp "
                        "heads)")
    if problems:
        valid = chapter_cp_degrees(seq_len, n_heads)
        fix = (f"world_size (= cp) values that pass every rule of chapter 07 with seq_len={seq_len}, "
               f"n_heads={n_heads}: {', '.join(map(str, valid))}" if valid else
               f"no world_size passes every rule of chapter 07 with seq_len={seq_len}, n_heads={n_heads}: "
               "choose an even n_heads and a seq_len that 4 divides, e.g. n_heads=4, seq_len=1024")
        raise ValueError(f"chapter 07 runs cp = world_size={world_size}: {'; '.join(problems)}; {fix}; or choose "
                         "seq_len / n_heads that it divides")
    resolve_backend(backend, world_size)


def chapter_cp_degrees(seq_len: int, n_heads: int) -> list[int]:
    """The world_size (= cp) values chapter 07 accepts for ``seq_len`` and ``n_heads`` (the backend aside):
    cp >= 2, 2·cp dividing seq_len (zigzag) and cp dividing n_heads (Ulysses), so never above n_heads.
    Raises ValueError for a non-positive size."""
    seq_len, n_heads = positive_int("seq_len", seq_len), positive_int("n_heads", n_heads)
    return [c for c in range(2, n_heads + 1) if n_heads % c == 0 and seq_len % (2 * c) == 0]


def model_cases(world_size: int, spec: str = "lab-tiny-llama") -> tuple[list[dict], list[str]]:
    """The whole-model parity cases chapter 07 runs on ``world_size`` ranks
    (:func:`labkit.experiments.context.cp_parity_rank`'s ``model_cases``): ring with zigzag, and Ulysses when
    ``world_size`` divides the model's heads (and its kv heads are repeated to them). Returns
    ``(cases, skipped)``, ``skipped`` saying why a case was left out. A case also needs the model's
    ``max_seq_len`` to hold 8·world_size tokens."""
    from labkit.theory.spec import get_spec

    m = get_spec(spec)
    cases, skipped = [], []
    if 8 * world_size > m.max_seq_len:
        return [], [f"{spec}: max_seq_len={m.max_seq_len} cannot hold 8·world_size={8 * world_size} tokens"]
    cases.append({"method": "ring", "load_balance": True})
    if m.n_heads % world_size == 0:
        cases.append({"method": "ulysses", "load_balance": False})
    else:
        skipped.append(f"ulysses on {spec}: cp={world_size} does not divide its n_heads={m.n_heads}")
    return cases, skipped


#: measured zigzag max/min kernel time within this of 1 counts as "even" in :func:`imbalance`'s conclusion
EVEN_TOLERANCE = 0.15


def imbalance(table, costs: dict | None = None, *, method: str = "ring") -> dict:
    """The causal imbalance of contiguous (naive) sharding vs zigzag, from a
    :func:`labkit.experiments.context.profile_table` (the configs whose ``cp`` is the largest in the table,
    causal), for ``method``:

    * counted (deterministic): ``blocks_naive`` / ``blocks_zigzag`` per rank and ``counted_naive_ratio``
      (last rank / first rank: cp when the kernel computes r+1 blocks on rank r) and
      ``counted_zigzag_ratio`` (busiest / least busy: 1);
    * measured: ``kernel_cpu_ms_naive`` / ``kernel_cpu_ms_zigzag`` per rank (least-disturbed repeat) and the
      same two ratios, ``measured_naive_ratio`` and ``measured_zigzag_ratio``;
    * predicted: ``predicted_naive_ratio`` = cp from the block counts, and, with ``costs`` from
      :func:`labkit.experiments.context.block_costs`, ``predicted_weighted_naive_ratio``: the same with each
      diagonal block weighted by its measured cost relative to a full block;
    * ``shows_imbalance`` (bool): the measured naive ratio exceeds both 1.2 and the measured zigzag ratio
      by 0.15 — the timing shows what the counts say;
    * ``zigzag_even`` (bool): the measured zigzag max/min is within :data:`EVEN_TOLERANCE` of 1; only then
      does the conclusion say zigzag evened the work out, otherwise it says how far from even it stayed;
    * ``conclusion``: one sentence written from these numbers (what this run showed, not what it should).

    Raises ValueError when the table has no causal naive and zigzag rows of ``method`` at cp >= 2."""
    check_choice("method", method, METHODS)
    t = table[table["method"] == method]
    cp = int(t["cp"].max()) if len(t) else 0
    t = t[t["cp"] == cp]
    if cp < 2 or set(t["load_balance"]) != {False, True}:
        raise ValueError(f"imbalance() needs naive and zigzag rows of method={method!r} at cp >= 2 in the table; "
                         f"got cp={cp} with load_balance in {sorted(set(t['load_balance']))}")
    naive = t[~t["load_balance"]].sort_values("rank")
    zz = t[t["load_balance"]].sort_values("rank")
    out = {"method": method, "cp": cp,
           "blocks_naive": naive["blocks"].tolist(), "blocks_zigzag": zz["blocks"].tolist(),
           "kernel_cpu_ms_naive": naive["kernel_cpu_ms"].tolist(),
           "kernel_cpu_ms_zigzag": zz["kernel_cpu_ms"].tolist()}
    out["counted_naive_ratio"] = out["blocks_naive"][-1] / out["blocks_naive"][0]
    out["counted_zigzag_ratio"] = max(out["blocks_zigzag"]) / min(out["blocks_zigzag"])
    out["predicted_naive_ratio"] = float(cp)
    if costs is not None:
        w = costs["diagonal_over_full"]
        work = [f + w * d for f, d in predicted_pair_blocks(cp, method=method)]
        out["predicted_weighted_naive_ratio"] = work[-1] / work[0]
    cpu_n, cpu_z = out["kernel_cpu_ms_naive"], out["kernel_cpu_ms_zigzag"]
    timed = all(x == x for x in cpu_n + cpu_z)  # NaN on a GPU: no CPU kernel time
    out["measured_naive_ratio"] = cpu_n[-1] / cpu_n[0] if timed else float("nan")
    out["measured_zigzag_ratio"] = max(cpu_z) / min(cpu_z) if timed else float("nan")
    out["zigzag_even"] = bool(timed and out["measured_zigzag_ratio"] <= 1.0 + EVEN_TOLERANCE)
    out["shows_imbalance"] = bool(timed and out["measured_naive_ratio"] > 1.2
                                  and out["measured_naive_ratio"] > out["measured_zigzag_ratio"] + 0.15)
    counted = (f"Counted: with contiguous sharding the last of {cp} ranks computed "
               f"{out['counted_naive_ratio']:.2f}x the first rank's attention blocks (predicted {cp}), with "
               f"zigzag the busiest computed {out['counted_zigzag_ratio']:.2f}x the least busy (predicted 1). ")
    weighted = ""
    if "predicted_weighted_naive_ratio" in out:
        weighted = (f"; {out['predicted_weighted_naive_ratio']:.2f} once a masked diagonal block costs "
                    f"{costs['diagonal_over_full']:.2f}x a full one, as measured here")
    if not timed:
        timing = "Measured: no CPU kernel time on a GPU (kernels run asynchronously); read the timeline instead."
    else:
        ratios = (f"last/first {out['measured_naive_ratio']:.2f} naive (predicted {cp} from the counts{weighted}), "
                  f"max/min {out['measured_zigzag_ratio']:.2f} zigzag")
        if out["shows_imbalance"]:
            zz_ratio = out["measured_zigzag_ratio"]
            if out["zigzag_even"]:
                after = (f"zigzag evens the work out (its busiest rank within {zz_ratio - 1:.0%} of the least busy, "
                         f"tolerance {EVEN_TOLERANCE:.0%}).")
            else:
                after = (f"zigzag narrowed the spread but did not even it out: its busiest rank still took "
                         f"{zz_ratio - 1:.0%} more kernel time than the least busy (counted blocks: equal), more than "
                         f"the {EVEN_TOLERANCE:.0%} this lab calls even.")
            timing = ("Measured kernel CPU time (least-disturbed repeat) shows the imbalance in this run: "
                      f"{ratios}; " + after)
        else:
            timing = (f"Measured kernel CPU time (least-disturbed repeat) does NOT show the imbalance in this run: "
                      f"{ratios}. The counts above are exact; the timing was blurred, most likely by other "
                      "processes sharing the cores (re-run section 4, raise repeats or seq_len).")
    out["conclusion"] = counted + timing
    return out
