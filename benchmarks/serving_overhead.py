"""The serving engine's decode steps vs a bare loop over the same model: what the server around the model
costs (queue, admission, scheduling, the per-step time series with the KV bytes measured).

Both decode the same requests from the same prefilled prompts with the same kernel
(labkit.parallel.serving.kv_cache.decode), one process, one thread: the engine through Engine.serve (batch
requests admitted at once, then decode steps at full batch), the bare loop as `logits = decode(...); tokens =
argmax` and nothing else. The two alternate round by round (which goes first alternates too), so machine load
hits them alike; the greedy tokens
must be the same. Prints decode tokens/s of each per round and, last, the engine/bare ratio: the median of the
per-round ratios with their spread (goal >= 0.9). The exit status is 1 when the goal is missed or the tokens
differ, 2 for bad arguments.

    PYTHONPATH=. python benchmarks/serving_overhead.py [--model lab-tiny-llama] [--batch 8] [--steps 32]
"""

from __future__ import annotations

import argparse
import sys
import time

from labkit.cli import run_main


def _bare(model, prompts, steps: int):
    """Prefill every prompt, then ``steps`` batched decode steps; returns (decode seconds, tokens per request)."""
    import torch

    from labkit.parallel.serving import decode, kv_cache_shape, prefill

    caches = [torch.zeros(kv_cache_shape(model, len(p) + steps + 1)) for p in prompts]
    first = [int(prefill(model, p, c).argmax()) for p, c in zip(prompts, caches)]
    toks = torch.tensor(first)
    pos = torch.tensor([len(p) for p in prompts])
    out = [[t] for t in first]
    t0 = time.perf_counter()
    for _ in range(steps):
        toks = decode(model, toks, pos, caches).argmax(-1)
        pos += 1
        for o, t in zip(out, toks.tolist()):
            o.append(t)
    return time.perf_counter() - t0, out


def _engine(model, requests, steps: int):
    """The same through Engine.serve; decode seconds from its series (first to last decode step)."""
    from labkit.parallel.serving import Engine

    res = Engine(model).serve(requests, len(requests))
    ser = res["series"]
    last_admit = max(i for i, r in enumerate(ser) if r["event"] == "admit")
    steps_rows = [r for r in ser[last_admit + 1 :] if r["event"] == "step"]
    if len(steps_rows) != steps:
        raise RuntimeError(f"the engine ran {len(steps_rows)} decode steps, expected {steps}")
    seconds = steps_rows[-1]["t_s"] - ser[last_admit]["t_s"]
    return seconds, [r["tokens"] for r in sorted(res["records"], key=lambda r: r["rid"])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="lab-tiny-llama", help="preset from data/models.yaml")
    ap.add_argument("--batch", type=int, default=8, help="requests decoded together (default 8)")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of every request")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=11, help="rounds, engine and bare loop alternating")
    ap.add_argument("--goal", type=float, default=0.9, help="engine/bare decode tokens/s to reach")
    args = ap.parse_args(argv)

    from labkit.checks import positive_float, positive_int
    from labkit.theory.spec import get_spec

    spec = get_spec(args.model)
    batch, steps = positive_int("--batch", args.batch), positive_int("--steps", args.steps)
    rounds, prompt_len = positive_int("--rounds", args.rounds), positive_int("--prompt-len", args.prompt_len)
    goal = positive_float("--goal", args.goal)
    spec.check_seq_len(prompt_len + steps + 1, "--prompt-len + --steps + 1")

    import torch

    from labkit.experiments.common import ratio_verdict
    from labkit.models import build_model
    from labkit.parallel.serving import prompt_tokens

    torch.set_num_threads(1)
    model = build_model(spec).eval()
    requests = [{"rid": i, "kind": "bench", "prompt_len": prompt_len, "max_new_tokens": steps + 1}
                for i in range(batch)]
    prompts = [prompt_tokens(r["rid"], prompt_len, spec.vocab_size) for r in requests]
    _bare(model, prompts, 2)  # warm-up, both paths
    _engine(model, [dict(r, max_new_tokens=3) for r in requests], 2)
    print(f"model {spec.name}, batch {batch}, prompt {prompt_len} tokens, {steps} decode steps per round, "
          f"1 thread; decode tokens/s (measured)")
    print(f"{'round':>5} {'engine':>10} {'bare':>10} {'ratio':>7}")
    ratios = []
    for i in range(rounds):
        if i % 2:  # alternate which goes first, so a drift in the machine's load favours neither
            b_s, b_tok = _bare(model, prompts, steps)
            e_s, e_tok = _engine(model, requests, steps)
        else:
            e_s, e_tok = _engine(model, requests, steps)
            b_s, b_tok = _bare(model, prompts, steps)
        if e_tok != b_tok:
            print("serving_overhead: the engine and the bare loop generated different tokens", file=sys.stderr)
            return 1
        e_tps, b_tps = batch * steps / e_s, batch * steps / b_s
        ratios.append(e_tps / b_tps)
        print(f"{i:>5} {e_tps:10.0f} {b_tps:10.0f} {ratios[-1]:7.3f}")
    line, met = ratio_verdict("engine/bare decode tokens/s, per round", ratios, goal, higher_is_better=True)
    print(line)
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(run_main("serving_overhead", main))
