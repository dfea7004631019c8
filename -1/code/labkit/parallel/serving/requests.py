"""A request inside the engine: its prompt, where it is (prefilling or decoding), the times it reached each
point, and the record it leaves when it ends.

:class:`Run` is the state of one :meth:`~labkit.parallel.serving.engine.Engine.serve` call. A request is a
plain dict: ``rid``, ``kind`` (a class label, e.g. short / long), ``prompt_len``,
``max_new_tokens`` (the client's max_tokens: the cache reserves prompt_len + max_new_tokens), optionally
``stop_after`` (the length at which the model would stop by itself, an end-of-sequence the lab's untrained
model cannot emit; default max_new_tokens) and ``arrival_s`` (seconds after the start of the run: an
open-loop arrival; absent: the request is there at the start, a closed loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from labkit.theory.spec import ModelSpec

#: server errors a request attempt can end with (failures: they count in the error rate)
ERROR_TYPES = ("rank_lost", "comm_timeout")
#: outcomes the client chose (not failures: counted on their own, outside the error rate)
CLIENT_OUTCOMES = ("cancelled",)
#: outcomes the server chose and repaired by itself: the attempt was stopped and the request re-queued
RETRIED_OUTCOMES = ("preempted",)
OUTCOMES = ("ok",) + CLIENT_OUTCOMES + RETRIED_OUTCOMES + ERROR_TYPES


def prompt_tokens(rid: int, prompt_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """The prompt of request ``rid``: int64 [prompt_len], a pure function of (seed, rid), so every rank of a
    TP group and every replica builds the same prompt."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + int(rid))
    return torch.randint(vocab_size, (prompt_len,), generator=g)


def check_requests(spec: ModelSpec, requests: list[dict]) -> None:
    """Raise ValueError (:meth:`ModelSpec.check_seq_len`) for a request whose prompt_len + max_new_tokens
    exceeds the model's max_seq_len (its cache could not hold it), or whose stop_after is below 1."""
    for r in requests:
        try:
            spec.check_seq_len(r["prompt_len"] + r["max_new_tokens"], "prompt_len + max_new_tokens")
        except ValueError as e:
            raise ValueError(f"request {r['rid']}: {e}; shorten the prompt or the output") from None
        if r.get("stop_after", 1) < 1:
            raise ValueError(f"request {r['rid']}: stop_after={r['stop_after']} must be >= 1 token")


def target_tokens(req: dict) -> int:
    """New tokens the request will get: its natural length, capped by its max_tokens."""
    return min(req.get("stop_after", req["max_new_tokens"]), req["max_new_tokens"])


@dataclass
class Live:
    """One attempt of a request in the engine. ``done`` prompt tokens already in the cache; ``token_ns``
    the time each new token was sampled."""

    req: dict
    attempt: int
    arrival_ns: int
    prompt: torch.Tensor | None = None
    tokens: list = field(default_factory=list)
    token_ns: list = field(default_factory=list)
    cache: torch.Tensor | None = None
    done: int = 0
    admitted_ns: int = 0
    prefill_start_ns: int = 0
    prefill_ns: int = 0
    model_version: int = 0

    @property
    def prefilling(self) -> bool:
        return self.done < self.req["prompt_len"]

    def reserved_tokens(self) -> int:
        return self.req["prompt_len"] + self.req["max_new_tokens"]

    def used_tokens(self) -> int:
        return self.done + max(0, len(self.tokens) - 1)  # the last token's K/V is written by the next step

    def add_token(self, tok: int, t_ns: int) -> bool:
        """Append a sampled token; True when the request has all it will get."""
        if not self.tokens:
            self.prefill_ns = t_ns - self.prefill_start_ns
        self.tokens.append(int(tok))
        self.token_ns.append(t_ns)
        return len(self.tokens) >= target_tokens(self.req)


def record(x: Live, status: str, end_ns: int, t0_ns: int) -> dict:
    """The plain-data record an attempt leaves (times in seconds; ``*_at_s`` since the run's ``t0_ns``):
    ``ttft_s`` (arrival to first token: queueing + prefill), ``queue_s``, ``prefill_s``, ``e2e_s``, ``tps``
    (decode tokens per second of this request after its first token), ``tpot_s`` (time per output token
    after the first: (last - first) / (n - 1)), ``itl_s`` (the gap before each token after the first),
    ``finish_reason`` ("stop": its natural length, "length": cut by max_tokens)."""
    n = len(x.tokens)
    first = x.token_ns[0] if n else 0
    dec_s = (end_ns - first) / 1e9 if n else 0.0
    arr = x.arrival_ns
    itl = [(b - a) / 1e9 for a, b in zip(x.token_ns, x.token_ns[1:])]
    nat = x.req.get("stop_after", x.req["max_new_tokens"])
    return {
        "rid": x.req["rid"], "kind": x.req.get("kind", ""), "prompt_len": x.req["prompt_len"],
        "max_new_tokens": x.req["max_new_tokens"], "new_tokens": n, "status": status, "attempt": x.attempt,
        "ttft_s": (first - arr) / 1e9 if n else float("nan"),
        "queue_s": (x.admitted_ns - arr) / 1e9 if x.admitted_ns else float("nan"),
        "prefill_s": x.prefill_ns / 1e9 if n else 0.0, "e2e_s": (end_ns - arr) / 1e9,
        "tps": (n - 1) / dec_s if n > 1 and dec_s > 0 else float("nan"),
        "tpot_s": (x.token_ns[-1] - first) / 1e9 / (n - 1) if n > 1 else float("nan"), "itl_s": itl,
        "arrival_at_s": (arr - t0_ns) / 1e9, "end_at_s": (end_ns - t0_ns) / 1e9, "model_version": x.model_version,
        "finish_reason": ("stop" if nat <= x.req["max_new_tokens"] else "length") if status == "ok" else "",
        "tokens": list(x.tokens)}


class RankLost(RuntimeError):
    """Raised inside the rank chosen to be lost, at the decode step chosen for it (failure injection)."""


def is_comm_failure(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed because a peer is gone (gloo: timed out, connection closed)."""
    text = str(e)
    return any(m in text for m in ("Timed out", "timed out", "Connection closed", "Connection reset",
                                   "Broken pipe", "recvBytes", "sendBytes"))


@dataclass
class Run:
    """The state of one :meth:`Engine.serve` call."""

    t0: int
    start: int
    pending: list  # (arrival_ns, request) not yet arrived, in arrival order
    queue: list  # requests arrived, not admitted
    attempt: dict
    arrival: dict
    log: object = None
    sync: object = None  # the TP group whose rank 0 decides the arrivals (open loop), or None
    live: list = field(default_factory=list)
    records: list = field(default_factory=list)
    series: list = field(default_factory=list)
    counts: dict = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    step: int = 0
    admitted: int = 0
    prefill_ns: int = 0
    decode_ns: int = 0
    last: dict = field(default_factory=dict)  # the tokens of the latest step, for the series
    cancel: dict | None = None
    cancel_at: int | None = None  # the decode step of the cancel storm
    swap: dict | None = None
    draining: bool = False
