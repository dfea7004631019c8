"""Open-loop serving workloads: when requests arrive and how long they are (pure Python, no torch).

* arrivals (:data:`ARRIVALS`): ``"poisson"`` at a rate (exponential gaps, the load a request-rate sweep uses),
  ``"burst"`` (``burst_size`` requests at the same instant, bursts arriving as a Poisson process of
  rate / burst_size: the same mean rate, a harsher queue), ``"trace"`` (arrival times and lengths read from
  a file: :func:`load_trace`);
* lengths: a short / long prompt mix (``long_fraction`` of the requests long, each class uniform over its
  ``(min, max)`` range), the natural output length uniform over ``output_len`` (where the model would stop
  by itself: ``stop_after``), and the client's ``max_tokens`` (the cap: generation stops there, and the KV
  cache reserves prompt + max_tokens; default the top of ``output_len``).

Every request is a dict ``{rid, kind, prompt_len, max_new_tokens, stop_after, arrival_s}`` that
:meth:`labkit.parallel.serving.Engine.serve` takes. The same seed gives the same workload on every rank.
"""

from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path

from labkit.checks import check_choice, positive_float, positive_int

ARRIVALS = ("poisson", "burst", "trace")


def _range(name: str, value) -> tuple[int, int]:
    """``value`` as an (lo, hi) pair of positive ints with lo <= hi (an int n means (n, n))."""
    lo, hi = (value, value) if isinstance(value, int) else tuple(value)
    lo, hi = positive_int(f"{name} (min)", lo), positive_int(f"{name} (max)", hi)
    if lo > hi:
        raise ValueError(f"{name}=({lo}, {hi}): the min must not exceed the max; use e.g. {name}=({hi}, {lo})")
    return lo, hi


def check_lengths(max_seq_len: int, *, short_prompt, long_prompt, output_len, max_tokens=None,
                  long_fraction: float = 0.25) -> dict:
    """Validate a length distribution against the model's context before anything is generated. Returns
    ``{"short_prompt": (lo, hi), "long_prompt": ..., "output_len": ..., "max_tokens": int}``.

    Raises ValueError naming the valid range: a range with min > max or a size < 1, ``long_fraction``
    outside 0..1, and the longest request the distribution can draw (longest prompt + max_tokens, what its
    cache reserves) beyond ``max_seq_len``."""
    short, long_, out = _range("short_prompt", short_prompt), _range("long_prompt", long_prompt), \
        _range("output_len", output_len)
    cap = out[1] if max_tokens is None else positive_int("max_tokens", max_tokens)
    lf = float(long_fraction)
    if not 0.0 <= lf <= 1.0 or math.isnan(lf):
        raise ValueError(f"long_fraction={long_fraction!r} must be in 0..1 (the share of long prompts)")
    longest = max(short[1], long_[1]) if lf > 0 else short[1]
    if longest + cap > max_seq_len:
        raise ValueError(f"the longest request is {longest} prompt + {cap} max_tokens = {longest + cap} tokens, beyond "
                         f"the model's max_seq_len={max_seq_len}: keep prompt + max_tokens <= {max_seq_len}, e.g. "
                         f"prompts up to {max_seq_len - cap} tokens with max_tokens={cap}")
    return {"short_prompt": short, "long_prompt": long_, "output_len": out, "max_tokens": cap}


def open_loop_workload(n_requests: int, rate_rps: float, *, arrival: str = "poisson", burst_size: int = 4,
                       short_prompt=(8, 24), long_prompt=(64, 96), long_fraction: float = 0.25,
                       output_len=(4, 12), max_tokens: int | None = None, max_seq_len: int = 128,
                       seed: int = 0) -> list[dict]:
    """``n_requests`` requests arriving at ``rate_rps`` on average (``arrival`` "poisson" or "burst"), with
    the length mix of the module docstring; the first arrives at time 0. Raises ValueError (before anything
    runs) for a rate <= 0 or NaN, an unknown arrival process, a burst_size < 1, and what
    :func:`check_lengths` refuses."""
    n_requests = positive_int("n_requests", n_requests)
    rate = positive_float("rate_rps (requests per second)", rate_rps)
    check_choice("arrival", arrival, ("poisson", "burst"))
    burst = positive_int("burst_size", burst_size) if arrival == "burst" else 1
    ln = check_lengths(max_seq_len, short_prompt=short_prompt, long_prompt=long_prompt, output_len=output_len,
                       max_tokens=max_tokens, long_fraction=long_fraction)
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n_requests):
        if i and i % burst == 0:
            t += rng.expovariate(rate / burst)  # Poisson: exponential gaps of mean 1/rate (bursts: burst/rate)
        kind = "long" if rng.random() < long_fraction else "short"
        lo, hi = ln["long_prompt"] if kind == "long" else ln["short_prompt"]
        out.append({"rid": i, "kind": kind, "prompt_len": rng.randint(lo, hi), "max_new_tokens": ln["max_tokens"],
                    "stop_after": rng.randint(*ln["output_len"]), "arrival_s": t})
    return out


def load_trace(path: str | Path, *, max_seq_len: int | None = None, max_tokens: int | None = None) -> list[dict]:
    """Requests from a trace file: CSV with a header, or JSON lines, with ``arrival_s`` (seconds, >= 0),
    ``prompt_len``, ``output_len`` (the natural length) and optionally ``max_tokens`` and ``kind`` per
    request (``max_tokens`` argument: one cap for every request instead). Sorted by arrival. Raises
    ValueError naming the line for a missing column, a negative or NaN arrival, a length < 1, and (with
    ``max_seq_len``) a request longer than the context; OSError for an unreadable file."""
    path = Path(path)
    text = path.read_text()
    if path.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        rows = list(csv.DictReader(text.splitlines()))
    out = []
    for i, row in enumerate(rows, start=1):
        try:
            arr, p, o = float(row["arrival_s"]), int(row["prompt_len"]), int(row["output_len"])
        except KeyError as e:
            raise ValueError(f"{path.name} row {i}: missing column {e}; a trace needs arrival_s, prompt_len, "
                             "output_len (optional: max_tokens, kind)") from None
        if not arr >= 0:
            raise ValueError(f"{path.name} row {i}: arrival_s={arr} must be a number >= 0 (seconds)")
        cap = max_tokens if max_tokens is not None else int(row.get("max_tokens") or o)
        for name, v in (("prompt_len", p), ("output_len", o), ("max_tokens", cap)):
            positive_int(f"{path.name} row {i}: {name}", v)
        if max_seq_len is not None and p + cap > max_seq_len:
            raise ValueError(f"{path.name} row {i}: prompt_len + max_tokens = {p + cap} exceeds the model's "
                             f"max_seq_len={max_seq_len}; use prompt_len + max_tokens <= {max_seq_len}")
        out.append({"kind": row.get("kind") or ("long" if p > 32 else "short"), "prompt_len": p,
                    "max_new_tokens": cap, "stop_after": o, "arrival_s": arr})
    out.sort(key=lambda r: r["arrival_s"])
    return [dict(r, rid=i) for i, r in enumerate(out)]


def save_trace(requests: list[dict], path: str | Path) -> Path:
    """Write ``requests`` as a CSV trace :func:`load_trace` reads back (arrival_s, prompt_len, output_len,
    max_tokens, kind)."""
    path = Path(path)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arrival_s", "prompt_len", "output_len", "max_tokens", "kind"])
        for r in requests:
            w.writerow([f"{r['arrival_s']:.6f}", r["prompt_len"], r.get("stop_after", r["max_new_tokens"]),
                        r["max_new_tokens"], r.get("kind", "")])
    return path


def scale_to_rate(requests: list[dict], rate_rps: float) -> list[dict]:
    """A trace replayed at mean rate ``rate_rps``: arrival times scaled by (the trace's own mean rate) /
    rate_rps, the first kept at 0 (the usual way to sweep load with a recorded trace). Raises ValueError
    for a rate <= 0 or NaN, or a trace of fewer than two distinct arrival times."""
    rate = positive_float("rate_rps (requests per second)", rate_rps)
    times = [r["arrival_s"] for r in requests]
    span = max(times) - min(times)
    if len(requests) < 2 or span <= 0:
        raise ValueError("a trace needs at least two distinct arrival times to be replayed at a rate")
    own = (len(requests) - 1) / span
    return [dict(r, arrival_s=(r["arrival_s"] - min(times)) * own / rate) for r in requests]


def mean_lengths(requests: list[dict]) -> dict:
    """Mean ``prompt_len`` and mean new tokens (min of stop_after and max_new_tokens) of a workload."""
    n = len(requests)
    return {"prompt_len": sum(r["prompt_len"] for r in requests) / n,
            "new_tokens": sum(min(r.get("stop_after", r["max_new_tokens"]), r["max_new_tokens"])
                              for r in requests) / n}
