"""What several experiments share: parity helpers on state dicts, several variants trained in one launch
(:func:`run_experiments`, :func:`throughput_rank`) and the tables made from their results (each column named
with the source of its number: measured, model or predicted).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import pandas as pd
import torch
import torch.nn as nn

from labkit.checks import positive_int
from labkit.models import TOLERANCES
from labkit.runtime.measure import model_state_bytes
from labkit.runtime.timeline import now_ns
from labkit.runtime.training import _unwrap, train_steps


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) weights as CPU tensors keyed like the unwrapped model's ``state_dict``.

    Uses ``model.full_state_dict()`` when the wrapper has one; DTensor entries (FSDP2) are gathered with
    ``full_tensor()`` (a collective: every rank must call this). Non-persistent buffers are not included.
    """
    if hasattr(model, "full_state_dict"):
        return model.full_state_dict()
    out = {}
    for k, v in _unwrap(model).state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().cpu().clone()
    return out


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| over the entries of two state dicts with the same keys (KeyError otherwise)."""
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b)


def assert_state_close(actual: dict, expected: dict, dtype: torch.dtype = torch.float32, what: str = "") -> None:
    """``torch.testing.assert_close`` per entry with :data:`labkit.models.TOLERANCES` [dtype]; the error names
    the entry and ``what``. Raises AssertionError (mismatch) or KeyError (missing entry)."""
    tol = TOLERANCES[dtype]
    if set(actual) != set(expected):
        raise AssertionError(f"{what}: keys differ: {sorted(set(actual) ^ set(expected))}")
    for k in expected:
        torch.testing.assert_close(actual[k], expected[k], **tol, msg=lambda m, k=k: f"{what} {k}: {m}")


def assert_ranks_identical(states: list[dict], what: str = "") -> None:
    """Every rank's tensors equal rank 0's exactly (data-parallel replicas must not drift).
    Raises AssertionError naming the rank, the entry and the largest difference."""
    for r, sd in enumerate(states[1:], start=1):
        for k, v in states[0].items():
            if not torch.equal(sd[k], v):
                diff = float((sd[k].float() - v.float()).abs().max())
                raise AssertionError(f"{what}: rank {r} differs from rank 0 in {k} (max |diff| = {diff:.3g})")


def optimizer_step_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's ``step`` counters (AdamW keeps one float32 scalar per parameter tensor it
    owns), the part of ``labkit.runtime.measure.model_state_bytes``'s ``optimizer`` that does not scale with Ψ."""
    return sum(v.numel() * v.element_size() for st in optimizer.state.values() for k, v in st.items()
               if k == "step" and isinstance(v, torch.Tensor))


# ------------------------------------------------------------------------------------------------------
# several variants in one launch
# ------------------------------------------------------------------------------------------------------
#: keys of a run dict that configure the loop; every other key is passed to the wrapper builder
LOOP_KEYS = ("variant", "label", "steps", "warmup_steps", "global_batch_size", "n_microbatches",
             "sync_microbatch", "record")


def run_experiments(ctx, wrappers: dict[str, Callable], runs: list[dict], *, model: str = "lab-tiny-llama",
                    steps: int = 3, warmup_steps: int = 0, global_batch_size: int = 8, seq_len: int = 32,
                    n_microbatches: int = 1, lr: float = 1e-3, seed: int = 0, data_seed: int = 0,
                    return_state: bool = True, record: bool = True, **wrap_options) -> list[dict]:
    """Inside a rank: train several variants one after the other, each from the same fresh weights
    (``build_model(model, seed)``) on the same data (``SyntheticLM(vocab_size, seq_len, data_seed)``).

    ``wrappers`` maps a variant name to a builder ``fn(module, ctx, lr=..., **options) -> (wrapped,
    optimizer)``. ``runs`` is a list of dicts: ``variant`` (a key of ``wrappers``), optional ``label``, any
    of :data:`LOOP_KEYS` overriding the keyword defaults, and builder options (overriding ``wrap_options``).

    Returns one dict per run (same order): ``variant``, ``label``, ``losses``, ``step_s``, ``tokens_per_s``,
    ``payload_bytes_per_step`` (measured), ``ring_bytes_per_step`` (model), ``socket_bytes_per_step``
    (measured, gloo) as :func:`train_steps`, and ``comm`` (per op: calls, nbytes, bytes_per_rank, each per
    timed step),
    ``memory`` (``labkit.runtime.measure.model_state_bytes`` after the last step: parameters, gradients, optimizer
    with its step counters), ``optimizer_steps`` (:func:`optimizer_step_bytes`), ``grads`` (last step,
    before the update; full gradients only), ``state`` (:func:`full_state_dict`, when ``return_state``),
    ``window_ns`` (start, end) of the run on the launch's common clock (slice ``LaunchResult.timeline``
    with :func:`window`).
    Raises ValueError for an unknown variant (naming the valid ones) or bad sizes.
    """
    from labkit.checks import check_choice
    from labkit.models import SyntheticLM, build_model
    from labkit.theory.spec import get_spec

    spec = get_spec(model)
    data = SyntheticLM(spec.vocab_size, seq_len, data_seed)
    out = []
    for run in runs:
        check_choice("variant", run.get("variant"), list(wrappers))
        loop = {"steps": steps, "warmup_steps": warmup_steps, "global_batch_size": global_batch_size,
                "n_microbatches": n_microbatches, "sync_microbatch": None, "record": record}
        loop.update({k: v for k, v in run.items() if k in LOOP_KEYS and k not in ("variant", "label")})
        options = {**wrap_options, **{k: v for k, v in run.items() if k not in LOOP_KEYS}}
        ctx.barrier()
        t0 = now_ns()
        module = build_model(spec, seed, device=ctx.device)
        named = list(module.named_parameters())
        wrapped, optimizer = wrappers[run["variant"]](module, ctx, lr=lr, **options)
        res = train_steps(ctx, wrapped, optimizer, data, grad_params=named, **loop)
        res["memory"] = model_state_bytes(wrapped, optimizer)
        res["optimizer_steps"] = optimizer_step_bytes(optimizer)
        if return_state:
            res["state"] = full_state_dict(wrapped)
        n = loop["steps"]
        summary: dict[str, dict] = {}
        for r in res.pop("comm"):
            s = summary.setdefault(r["op"], {"calls": 0, "nbytes": 0, "bytes_per_rank": 0.0})
            s["calls"] += 1 / n
            s["nbytes"] += r["nbytes"] / n
            s["bytes_per_rank"] += r["bytes_per_rank"] / n
        res["comm"] = summary
        res.update(variant=run["variant"], label=run.get("label", run["variant"]),
                   n_microbatches=loop["n_microbatches"])
        if hasattr(wrapped, "close"):
            wrapped.close()
        del wrapped, optimizer, module
        ctx.barrier()
        res["window_ns"] = (t0 - ctx.clock_offset_ns, now_ns() - ctx.clock_offset_ns)
        out.append(res)
    return out


def window(df, window_ns: tuple[int, int]):
    """The rows of a timeline frame inside ``window_ns`` = (start, end) (a run's ``window_ns``)."""
    lo, hi = window_ns
    return df[(df["start_ns"] >= lo) & (df["end_ns"] <= hi)]


def _runs(results) -> list[list[dict]]:
    """Per rank, the list of run dicts (a rank may return the list itself or a dict with a ``runs`` entry)."""
    return [r["runs"] if isinstance(r, dict) else r for r in results]


#: column names of :func:`summarize` (and the chapters' tables): each says where its number comes from
PAYLOAD = "logged payload S per step (measured: what the code issued)"
RING = "ring bytes per rank per step (model: S x factor)"
SOCKET = "socket bytes written per rank per step (measured: gloo)"


def summarize(results) -> pd.DataFrame:
    """One row per run of a launch of :func:`run_experiments` (``results``: the LaunchResult, one list of run
    dicts per rank, or one dict with a ``runs`` list per rank): ``label``, ``tokens_per_s`` (measured; the
    slowest rank's, since ranks step together), ``step_s`` (median over timed steps, slowest rank), per rank
    and step on rank 0: :data:`PAYLOAD` (measured: the S the code issued), :data:`RING` (model: S x ring
    factor), :data:`SOCKET` (measured: bytes written to gloo's sockets; NaN where not measurable),
    ``final_loss``, and measured model-state bytes on rank 0 (``parameters``, ``gradients``, ``optimizer``,
    ``model_states``)."""
    results = _runs(results)
    rows = []
    for i, r0 in enumerate(results[0]):
        per_rank = [results[k][i] for k in range(len(results))]
        mem = r0["memory"]
        rows.append({"label": r0["label"], "variant": r0["variant"],
                     "tokens_per_s": min(r["tokens_per_s"] for r in per_rank),
                     "step_s": max(statistics.median(r["step_s"]) for r in per_rank),
                     PAYLOAD: r0["payload_bytes_per_step"], RING: r0["ring_bytes_per_step"],
                     SOCKET: float("nan") if r0["socket_bytes_per_step"] is None else r0["socket_bytes_per_step"],
                     "final_loss": r0["losses"][-1],
                     **mem, "model_states": sum(mem.values())})
    return pd.DataFrame(rows)


GLOO = "bytes per rank per step (model: gloo's algorithms, reduce-scatter sent as an all-reduce)"
#: per op, bytes one rank sends per byte of S with gloo's CPU algorithms: a ring all-reduce and all-gather,
#: a reduce-scatter that runs a whole all-reduce and keeps its shard (chapter 02 measures this), an all-to-all
#: that sends every peer its chunk, and point-to-point: the sender sends S, the receiver nothing
GLOO_FACTORS = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
                "reduce_scatter": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
                "send": lambda n: 1.0, "recv": lambda n: 0.0}


def wire_table(results) -> pd.DataFrame:
    """Per run of a :func:`run_experiments` launch (``results``: the LaunchResult), bytes one rank sends per
    step three ways, each labelled with its source: :data:`RING` (model: the logged S x ring factor),
    :data:`GLOO` (model: the logged S x :data:`GLOO_FACTORS`, the algorithms gloo runs on CPU) and
    :data:`SOCKET` (measured on rank 0: what the process wrote, /proc/self/io; NaN where not measurable), and
    ``measured / gloo model``. The group size is the launch's world size (every run here uses the world).
    Raises ValueError for a collective without a gloo factor."""
    runs = _runs(results)
    n = len(runs)
    rows = []
    for r0 in runs[0]:
        gloo = 0.0
        for op, c in r0["comm"].items():
            if op not in GLOO_FACTORS:
                raise ValueError(f"op={op!r} has no gloo model; valid: {', '.join(GLOO_FACTORS)}")
            gloo += c["nbytes"] * GLOO_FACTORS[op](n)
        sock = r0["socket_bytes_per_step"]
        rows.append({"label": r0["label"], RING: r0["ring_bytes_per_step"], GLOO: gloo,
                     SOCKET: float("nan") if sock is None else sock,
                     "measured / gloo model": float("nan") if sock is None or gloo == 0 else sock / gloo})
    return pd.DataFrame(rows)


class ParityError(RuntimeError):
    """Variants that must train the same model did not: a speed ratio between them would mean nothing."""


class Throughput(dict):
    """{label: [measured global tokens/s of each round]}, with ``parity``: one row per checked pair
    (:func:`same_model_rows`)."""

    parity: list


def same_model_rows(losses: dict[str, list[float]], states: dict[str, dict], pairs, *, lr: float,
                    steps: int) -> list[dict]:
    """Did each pair ``(a, b)`` of variants train the same model? From the same weights and batches: every
    step's loss within fp32's :data:`labkit.models.TOLERANCES` (rtol 1e-4, atol 1e-5) and the full weights
    after ``steps`` AdamW steps within rtol 1e-4, atol 1e-5 + 0.1 * lr * steps (Adam divides each gradient by
    its running RMS, so a rounding-level gradient difference near eps moves an element by up to lr per step;
    a wrong gradient moves the weights by far more). One row per pair: ``pair``, ``max_loss_diff``,
    ``max_weight_diff``, ``same`` (both within tolerance)."""
    tol = TOLERANCES[torch.float32]
    w_atol = tol["atol"] + 0.1 * lr * steps
    rows = []
    for a, b in pairs:
        la, lb = losses[a], losses[b]
        loss_ok = len(la) == len(lb) and all(abs(x - y) <= tol["atol"] + tol["rtol"] * abs(y) for x, y in zip(la, lb))
        sa, sb = states[a], states[b]
        keys_ok = set(sa) == set(sb)
        w_ok = keys_ok and all(torch.allclose(sa[k].float(), sb[k].float(), rtol=tol["rtol"], atol=w_atol) for k in sb)
        rows.append({"pair": f"{a}/{b}", "max_loss_diff": max((abs(x - y) for x, y in zip(la, lb)), default=0.0),
                     "max_weight_diff": max_abs_diff(sa, sb) if keys_ok else float("inf"),
                     "weight_atol": w_atol, "same": bool(loss_ok and w_ok)})
    return rows


def throughput_rank(ctx, wrappers: dict[str, Callable], runs: list[dict], *, model: str = "lab-small-llama",
                    steps: int = 3, repeats: int = 3, warmup_steps: int = 1, global_batch_size: int = 8,
                    seq_len: int = 128, lr: float = 1e-3, seed: int = 0, data_seed: int = 0, same_model=(),
                    **wrap_options) -> Throughput:
    """Rank function for fair speed comparisons: build every run's wrapped model once (same weights, same
    data), warm each up, then time ``steps`` steps of each in turn, ``repeats`` rounds (interleaving spreads
    machine noise over all variants alike). No timeline events; communication is not logged.

    ``runs``: dicts with ``variant`` (a key of ``wrappers``), optional ``label`` and builder options.
    ``same_model``: pairs of labels that must have trained the same model (:func:`same_model_rows` on every
    step's loss and the full weights at the end); a pair that did not raises :class:`ParityError` on every
    rank, so no speed ratio of a variant that trains something else is ever reported.
    Returns {label: [measured global tokens/s of each round]} (this rank's clock; ranks step together), a
    :class:`Throughput` whose ``parity`` holds the rows of the checked pairs.
    Raises ValueError for an unknown variant or model, or non-positive steps / repeats / batch sizes.
    """
    from labkit.checks import check_choice
    from labkit.models import SyntheticLM, build_model
    from labkit.theory.spec import get_spec

    spec = get_spec(model)
    data = SyntheticLM(spec.vocab_size, seq_len, data_seed)
    labels = [run.get("label", run.get("variant")) for run in runs]
    unknown = sorted({x for pair in same_model for x in pair} - set(labels))
    if unknown:
        raise ValueError(f"same_model names {', '.join(map(repr, unknown))}, not a run; runs: {', '.join(labels)}")
    built, losses = [], {}
    for run in runs:
        check_choice("variant", run.get("variant"), list(wrappers))
        options = {**wrap_options, **{k: v for k, v in run.items() if k not in ("variant", "label")}}
        module = build_model(spec, seed, device=ctx.device)
        wrapped, opt = wrappers[run["variant"]](module, ctx, lr=lr, **options)
        label = run.get("label", run["variant"])
        r = train_steps(ctx, wrapped, opt, data, steps=1, warmup_steps=warmup_steps,
                        global_batch_size=global_batch_size, record=False)
        losses[label] = list(r["losses"])
        built.append((label, wrapped, opt))
    out = Throughput({label: [] for label, _, _ in built})
    for _ in range(positive_int("repeats", repeats)):
        for label, wrapped, opt in built:
            r = train_steps(ctx, wrapped, opt, data, steps=steps, global_batch_size=global_batch_size, record=False)
            out[label].append(global_batch_size * seq_len * steps / sum(r["step_s"]))
            losses[label] += r["losses"]
    states = {label: full_state_dict(wrapped) for label, wrapped, _ in built if any(label in p for p in same_model)}
    out.parity = same_model_rows(losses, states, same_model, lr=lr, steps=warmup_steps + 1 + repeats * steps)
    for _, wrapped, _ in built:
        if hasattr(wrapped, "close"):
            wrapped.close()
    bad = [r for r in out.parity if not r["same"]]
    if bad:
        raise ParityError("; ".join(f"{r['pair']} did not train the same model (max |loss diff| "
                                    f"{r['max_loss_diff']:.2e}, max |weight diff| {r['max_weight_diff']:.2e}, "
                                    f"weights allowed {r['weight_atol']:.1e})" for r in bad)
                          + ": no speed ratio of a variant that trains something else")
    return out


def exposure_table(results) -> pd.DataFrame:
    """Per run of a :func:`run_experiments` launch (``results``: the LaunchResult): measured communication
    time on the timeline, the part hidden behind compute, and the exposed rest
    (:func:`labkit.runtime.timeline.exposed_ns`), in ms per timed step, averaged over ranks."""
    from labkit.runtime.timeline import exposed_ns

    rows = []
    for r0 in _runs(results)[0]:
        df = window(results.timeline, r0["window_ns"])
        steps = len(r0["step_s"])
        if not len(df[df["kind"] == "comm"]):
            rows.append({"label": r0["label"], "comm_ms": 0.0, "hidden_ms": 0.0, "exposed_ms": 0.0,
                         "hidden_fraction": 0.0})
            continue
        e = exposed_ns(df).mean()
        rows.append({"label": r0["label"], "comm_ms": e["total_ns"] / 1e6 / steps,
                     "hidden_ms": e["hidden_ns"] / 1e6 / steps, "exposed_ms": e["exposed_ns"] / 1e6 / steps,
                     "hidden_fraction": float(e["hidden_fraction"])})
    return pd.DataFrame(rows)


def per_rank(results, label: str) -> list[dict]:
    """Every rank's run dict for the run called ``label`` (KeyError naming the labels if there is none)."""
    runs = _runs(results)
    labels = [r["label"] for r in runs[0]]
    if label not in labels:
        raise KeyError(f"no run labelled {label!r}; runs: {', '.join(labels)}")
    i = labels.index(label)
    return [rr[i] for rr in runs]


def replica_spread(results, what: str = "grads") -> pd.Series:
    """Per run label, the largest |difference| between any rank's ``what`` (``grads`` at the last step, or
    ``state``) and rank 0's: 0.0 when the replicas agree exactly (as data parallelism requires)."""
    runs = _runs(results)
    out = {}
    for i, r0 in enumerate(runs[0]):
        ref = r0.get(what) or {}
        out[r0["label"]] = max((max_abs_diff(rr[i][what], ref) for rr in runs[1:] if ref), default=0.0)
    return pd.Series(out, name=f"max |{what} - rank 0 {what}|")


def ratio_verdict(name: str, ratios, goal: float, *, higher_is_better: bool) -> tuple[str, bool]:
    """One line for a benchmark's headline ratio, measured over several rounds: the median of ``ratios``,
    their spread (min and max), and whether the median meets ``goal`` (``>= goal`` when
    ``higher_is_better``, else ``<= goal``). Returns (line, met); a benchmark prints the line last and exits
    non-zero when not met. Raises ValueError for no ratio or a non-finite one."""
    import math

    vals = [float(r) for r in ratios]
    if not vals or not all(math.isfinite(v) for v in vals):
        raise ValueError(f"ratios={vals!r} must be one or more finite numbers")
    med = statistics.median(vals)
    met = med >= goal if higher_is_better else med <= goal
    rel = ">=" if higher_is_better else "<="
    line = (f"{name} = {med:.3f} (median of {len(vals)}; spread {min(vals):.3f} to {max(vals):.3f}; measured) "
            f"goal {rel} {goal:.2f}: {'met' if met else 'NOT met'}")
    return line, met
