"""Chapter 07 (context parallelism): its parameter check, the whole-model cases it runs, and the causal
imbalance verdict written from the numbers of its run.

The strategy is :mod:`labkit.parallel.context`, the predictions :mod:`labkit.theory.context`, the rank
functions it launches :func:`labkit.experiments.context.cp_parity_rank` and
:func:`labkit.experiments.context.cp_profile_rank`.
"""

from __future__ import annotations

from labkit.chapters.common import check_prediction, check_world_size
from labkit.checks import check_choice, positive_int
from labkit.theory.context import METHODS, predicted_pair_blocks


def chapter_sizes(world_size: int, *, emulate=None, emulate_world_size: int | None = None,
                  seq_len: int | None = None, n_heads: int | None = None) -> dict:
    """The sizes chapter 07 runs with, each parameter left None chosen from ``world_size``:

    * ``emulate_world_size`` (the cp of the emulated run): max(8, world_size) when ``emulate`` is set, else None;
    * ``n_heads``: the smallest multiple of world_size that is >= 4 (Ulysses gives each rank n_heads/cp heads);
    * ``seq_len``: the smallest multiple of 2·cp of both runs (zigzag cuts the sequence into 2·cp chunks) that
      is >= 1024.

    Values given are returned unchanged (:func:`check_chapter` validates them). Returns ``{"seq_len",
    "n_heads", "emulate_world_size"}``."""
    import math

    if emulate is None:
        emulate_world_size = None
    elif emulate_world_size is None:
        emulate_world_size = max(8, world_size)
    if n_heads is None:
        n_heads = world_size * math.ceil(4 / world_size)
    if seq_len is None:
        unit = math.lcm(2 * world_size, 2 * (emulate_world_size or 1))
        seq_len = unit * math.ceil(1024 / unit)
    return {"seq_len": seq_len, "n_heads": n_heads, "emulate_world_size": emulate_world_size}


def check_chapter(*, world_size: int, seq_len: int | None, n_heads: int | None, head_dim: int, batch: int,
                  repeats: int, backend: str = "auto", emulate=None, emulate_world_size: int | None = None,
                  emulate_model: str | None = "llama-3-8b", emulate_seq_len: int = 8192, my_prediction=None) -> dict:
    """Validate chapter 07's parameters before anything is launched (the chapter's first code cell) and return
    what it runs with: ``{"shape": {batch, n_heads, seq_len, head_dim}, "emulate_world_size"}``
    (:func:`chapter_sizes` fills the None ones from world_size).

    Raises ValueError naming the value and the fix: world_size < 2 (context parallelism splits the sequence
    over ranks: one rank has nothing to exchange), 2·world_size not dividing seq_len (zigzag cuts the
    sequence into 2·cp chunks), world_size not dividing n_heads (Ulysses), sizes or repeats < 1, a backend
    the machine cannot run (:func:`labkit.runtime.launcher.resolve_backend`), an ``emulate`` profile or
    ``emulate_world_size`` the profile's nodes cannot hold (or below 2, or 2·it not dividing seq_len), an
    ``emulate_model`` that is not a preset or an ``emulate_seq_len`` beyond its ``max_seq_len``, or a
    ``my_prediction`` that is not None or a number."""
    from labkit.runtime.launcher import resolve_backend

    world_size = check_world_size("07", world_size, why="context parallelism splits the sequence over ranks and "
                                  "exchanges keys and values between them")
    check_prediction(my_prediction, what="a number (your guess of the naive / zigzag step time ratio, e.g. 1.5)")
    sizes = chapter_sizes(world_size, emulate=emulate, emulate_world_size=emulate_world_size, seq_len=seq_len,
                          n_heads=n_heads)
    seq_len, n_heads, ecp = sizes["seq_len"], sizes["n_heads"], sizes["emulate_world_size"]
    for name, value in (("seq_len", seq_len), ("n_heads", n_heads), ("head_dim", head_dim), ("batch", batch),
                        ("repeats", repeats)):
        positive_int(name, value)
    if ecp is not None:
        ecp = check_world_size("07", ecp, why="the emulated run is context parallel too") if ecp >= 2 else \
            _bad_ecp(ecp)
        # ValueError naming the valid profiles / world sizes, the model presets or the model's max_seq_len
        emulation_plan(emulate, ecp, model=emulate_model, model_seq_len=emulate_seq_len, seq_len=seq_len,
                       n_heads=n_heads, head_dim=head_dim)
        if seq_len % (2 * ecp):
            raise ValueError(f"2·emulate_world_size={2 * ecp} does not divide seq_len={seq_len} (zigzag cuts the "
                             "sequence into 2·cp chunks); leave seq_len=None to have it chosen, or choose one "
                             f"that {2 * ecp} divides")
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
    return {"shape": {"batch": batch, "n_heads": n_heads, "seq_len": seq_len, "head_dim": head_dim},
            "emulate_world_size": ecp}


def _bad_ecp(ecp):
    raise ValueError(f"emulate_world_size={ecp} must be >= 2 (the emulated run is context parallel: cp >= 2); "
                     "leave it None (8) or set emulate=None to skip the emulated run")


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
    out["measured_step_ratio"] = max(cpu_n) / max(cpu_z) if timed else float("nan")
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


# ------------------------------------------------------------------------------------------------------
# the plan tables, the emulated run and the sentences written from the numbers
# ------------------------------------------------------------------------------------------------------
def zigzag_plan(cp: int):
    """The zigzag ring schedule as a rank x step table of ``q←k:kind`` cells (query chunk, key chunk, first
    letter of full / diagonal / skip), from :func:`labkit.theory.context.ring_schedule` (pure Python)."""
    import pandas as pd

    from labkit.theory.context import ring_schedule

    zz = pd.DataFrame(ring_schedule(cp, load_balance=True))
    zz["pair"] = zz["q_chunk"].astype(str) + "←" + zz["k_chunk"].astype(str) + ":" + zz["kind"].str[0]
    return zz.pivot_table(index="rank", columns="step", values="pair", aggfunc=" ".join)


def predicted_step_ratio(cp: int, *, causal: bool = True, method: str = "ring") -> float:
    """The step time of contiguous (naive) sharding over zigzag's, predicted from the block counts: the busiest
    rank sets the step, so max(naive blocks) / max(zigzag blocks) (:func:`predicted_blocks`; 4cp/(2cp+1)
    causal, 1 without the mask). Pure Python."""
    from labkit.theory.context import predicted_blocks

    return (max(predicted_blocks(cp, causal=causal, method=method))
            / max(predicted_blocks(cp, causal=causal, method=method, load_balance=True)))


def emulation_plan(emulate, cp: int, *, model: str | None, model_seq_len: int, seq_len: int, n_heads: int,
                   head_dim: int):
    """``emulate`` (a profile name, Cluster or dict as ``launch`` takes) for ``cp`` ranks, charged as one attention
    layer of ``model`` at ``model_seq_len`` tokens (:func:`labkit.theory.context.attention_charge`); ``model``
    None: the profile as given (the lab's own sizes). Raises ValueError as
    :func:`labkit.runtime.emulate.resolve` and ``attention_charge`` do."""
    from labkit.runtime.emulate import EmulationPlan, resolve
    from labkit.theory.context import attention_charge

    plan = resolve(emulate, cp)
    if model is None:
        return plan
    charge = attention_charge(model=model, seq_len=model_seq_len, lab_seq_len=seq_len, lab_n_heads=n_heads,
                              lab_head_dim=head_dim)
    return EmulationPlan(plan.cluster, charge, cp)


def run_emulated(cp: int | None, *, emulate, seq_len: int, n_heads: int, head_dim: int, batch: int = 1,
                 model: str | None = "llama-3-8b", model_seq_len: int = 8192, causal: bool = True,
                 backend: str = "auto") -> dict | None:
    """Chapter 07's emulated run: one ring attention step (:func:`labkit.experiments.context.cp_step_rank`,
    contiguous and zigzag sharding, forward + backward) on ``cp`` ranks, charged as the ``emulate`` profile would
    run it — as one attention layer of ``model`` at ``model_seq_len`` tokens (:func:`emulation_plan`; None: the lab's
    sizes, where the ring's per-step latency hides the compute). ``emulate`` None (or cp None): prints that no
    emulated run was made and returns None.

    Returns :func:`emulated_findings` of the run (deterministic: the same numbers on every machine and load),
    with ``result`` (the launch) added."""
    from labkit import launch
    from labkit.experiments import context as cpe

    if emulate is None or cp is None:
        print("emulate=None: no emulated run; the figures show the measured run and the prediction only.")
        return None
    configs = [{"method": "ring", "load_balance": False}, {"method": "ring", "load_balance": True}]
    plan = emulation_plan(emulate, cp, model=model, model_seq_len=model_seq_len, seq_len=seq_len,
                          n_heads=n_heads, head_dim=head_dim)
    res = launch(cpe.cp_step_rank, cp, configs, causal=causal, emulate=plan, backend=backend,
                 batch=batch, n_heads=n_heads, seq_len=seq_len, head_dim=head_dim)
    out = emulated_findings(cpe.emulated_config_table(res), causal=causal)
    out["result"] = res
    return out


#: a naive / zigzag step ratio within this of 1 counts as "the same step time" in :func:`emulated_findings`
SAME_STEP_TOLERANCE = 0.05


def emulated_findings(table, *, causal: bool = True) -> dict:
    """What an emulated naive-vs-zigzag ring run shows, from :func:`labkit.experiments.context.
    emulated_config_table` (one config with ``load_balance`` False, one True): per rank ``compute_naive_ms`` /
    ``compute_zigzag_ms``, ``step_naive_ms`` / ``step_zigzag_ms`` (the slowest rank's window), ``step_ratio``
    (naive / zigzag) beside ``predicted_step_ratio`` (:func:`predicted_step_ratio`), ``last_over_first``
    (naive compute, last rank / first), ``zigzag_faster`` (step_ratio above 1 + :data:`SAME_STEP_TOLERANCE`),
    ``label`` and ``conclusion``: one sentence written from these numbers."""
    from labkit.theory.context import predicted_blocks

    naive = table[~table["load_balance"]].sort_values("rank")
    zz = table[table["load_balance"]].sort_values("rank")
    cp, label = int(table["cp"].max()), table["label"].iloc[0]
    out = {"cp": cp, "label": label, "compute_naive_ms": naive["compute_ms"].tolist(),
           "compute_zigzag_ms": zz["compute_ms"].tolist(),
           "step_naive_ms": float(naive["window_ms"].max()), "step_zigzag_ms": float(zz["window_ms"].max()),
           "predicted_step_ratio": predicted_step_ratio(cp, causal=causal)}
    out["step_ratio"] = out["step_naive_ms"] / out["step_zigzag_ms"]
    out["last_over_first"] = out["compute_naive_ms"][-1] / out["compute_naive_ms"][0]
    out["zigzag_faster"] = bool(out["step_ratio"] > 1 + SAME_STEP_TOLERANCE)
    naive_mean = sum(out["compute_naive_ms"]) / cp
    out["zigzag_over_naive_mean"] = max(out["compute_zigzag_ms"]) / naive_mean
    nb, zb = predicted_blocks(cp, causal=causal), predicted_blocks(cp, causal=causal, load_balance=True)
    out["predicted_zigzag_over_naive_mean"] = max(zb) / (sum(nb) / cp)
    head = (f"{label}, cp={cp}, {'causal' if causal else 'not causal'}: with contiguous sharding the last rank's "
            f"attention compute is {out['last_over_first']:.2f}x the first rank's")
    steps = (f"the step takes {out['step_naive_ms']:.3g} ms naive against {out['step_zigzag_ms']:.3g} ms zigzag "
             f"({out['step_ratio']:.2f}x; the block counts predict {out['predicted_step_ratio']:.2f}x)")
    if out["zigzag_faster"]:
        z, zp = out["zigzag_over_naive_mean"], out["predicted_zigzag_over_naive_mean"]
        cost = ("more" if z > zp * 1.05 else "less" if z < zp * 0.95 else "about what the counts say")
        out["conclusion"] = (f"{head}, and every rank waits for the busiest one: {steps}. Zigzag removes the "
                             f"imbalance and with it the wait; each zigzag rank computes {z:.2f}x the naive ranks' "
                             f"mean where the counted blocks say {zp:.2f}x"
                             + ("" if cost.startswith("about") else f" ({cost} than counted)") + ".")
    else:
        out["conclusion"] = (f"{head}: {steps}. There is no imbalance for zigzag to remove here — the two steps "
                             f"are within {SAME_STEP_TOLERANCE:.0%} of each other.")
    return out


def diagonal_finding(costs: dict, cp: int, *, method: str = "ring") -> str:
    """One sentence on what the measured cost of a masked diagonal block (``costs`` from
    :func:`labkit.experiments.context.block_costs`) does to the naive last/first ratio predicted at ``cp``:
    costlier than a full block pulls the weighted prediction toward 1, cheaper pushes it away, within 5 % of
    a full block leaves it at the plain count."""
    from labkit.theory.context import predicted_pair_blocks

    w = costs["diagonal_over_full"]
    work = [f + w * d for f, d in predicted_pair_blocks(cp, method=method)]
    weighted = work[-1] / work[0]
    base = (f"A masked diagonal block cost {w:.2f}x a full one in this process ({costs['diagonal_ms']:.3g} vs "
            f"{costs['full_ms']:.3g} ms); every rank computes one, so the naive last/first ratio predicted with "
            f"that weight is {weighted:.2f} against the plain count's {cp}")
    if w > 1.05:
        return base + ": the costlier diagonal pulls the ratio toward 1."
    if w < 0.95:
        return base + ": the cheaper diagonal pushes the ratio above the count."
    return base + ": the diagonal costs about what a full block does, so the count stands."


def bytes_finding(frame, *, what: str = "predicted", value: str = "sent_bytes") -> str:
    """How bytes sent per rank change with cp, for each method of ``frame`` (columns ``method``, ``cp`` and
    ``value``; rows with cp >= 2), in one sentence per method: rises / falls / stays within 5 % from the
    smallest to the largest cp, with both numbers (MB = 1e6 bytes)."""
    parts = []
    for method, g in frame[frame["cp"] >= 2].dropna(subset=[value]).groupby("method", sort=False):
        g = g.sort_values("cp")
        if len(g) < 2:
            continue
        a, b = float(g[value].iloc[0]), float(g[value].iloc[-1])
        trend = "stays flat" if abs(b / a - 1) <= 0.05 else ("rises" if b > a else "falls")
        parts.append(f"{method}: {trend} from {a / 1e6:.3g} MB at cp={int(g['cp'].iloc[0])} to {b / 1e6:.3g} MB at "
                     f"cp={int(g['cp'].iloc[-1])}")
    if not parts:
        return f"Bytes sent per rank ({what}): fewer than two cp >= 2 in this run, no trend to read."
    return f"Bytes sent per rank, one forward + backward ({what}): " + "; ".join(parts) + "."


def imbalance_figure(table, emulated: dict | None = None):
    """Chapter 07's headline figure: attention work per rank / its group's mean, causal, contiguous (left) and
    zigzag (right): ``measured`` (kernel CPU time of the ``table``'s largest cp,
    :func:`labkit.experiments.context.profile_table`, ring), ``emulated (<profile>)`` (compute per rank of
    :func:`run_emulated`, when given) and ``predicted (blocks: r+1 naive, (2cp+1)/4 zigzag)`` for both cps."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from labkit.style import label_color
    from labkit.theory.context import predicted_blocks

    t = table[(table["method"] == "ring") & (table["cp"] == table["cp"].max())]
    cp = int(t["cp"].max())
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True,
                        subplot_titles=("contiguous (naive) sharding", "zigzag (load-balanced) sharding"))
    pred_name = "predicted (blocks: r+1 naive, (2cp+1)/4 zigzag)"
    for col, lb in ((1, False), (2, True)):
        m = t[t["load_balance"] == lb].sort_values("rank")
        series = [("measured", list(m["rank"]), list(m["compute_share"]))]
        cps = [cp]
        if emulated is not None:
            work = emulated["compute_zigzag_ms" if lb else "compute_naive_ms"]
            mean = sum(work) / len(work)
            series.append((emulated["label"], list(range(len(work))), [w / mean for w in work]))
            cps.append(emulated["cp"])
        for name, x, y in series:
            fig.add_bar(x=x, y=y, name=name, legendgroup=name, showlegend=col == 1, row=1, col=col,
                        marker_color=label_color(name), opacity=0.85 if "measured" in name else 1.0)
        for i, c in enumerate(cps):
            b = predicted_blocks(c, load_balance=lb)
            fig.add_trace(go.Scatter(x=list(range(c)), y=[v / (sum(b) / c) for v in b], mode="markers+lines",
                                     name=pred_name, legendgroup=pred_name, showlegend=col == 1 and i == 0,
                                     line={"dash": "dash", "color": label_color(pred_name)},
                                     marker={"symbol": "diamond", "size": 9}), row=1, col=col)
    fig.update_layout(barmode="group", height=430, legend={"orientation": "h", "y": -0.2},
                      title=f"causal attention work per rank / mean: measured here at cp={cp}"
                      + (f", emulated at cp={emulated['cp']}" if emulated else "") + ", predicted for both")
    fig.update_xaxes(title_text="rank")
    fig.update_yaxes(title_text="work / mean", row=1, col=1)
    return fig


def parity_shape(world_size: int, n_heads: int) -> dict:
    """The attention sizes of chapter 07's parity launch (:func:`labkit.experiments.context.cp_parity_rank`):
    the chapter's ``n_heads`` (so that Ulysses can split them ``world_size`` ways) and the smallest multiple of
    2·world_size that is >= 32 tokens (zigzag cuts the sequence into 2·cp chunks)."""
    import math

    unit = 2 * positive_int("world_size", world_size)
    return {"n_heads": positive_int("n_heads", n_heads), "seq_len": unit * math.ceil(32 / unit)}
