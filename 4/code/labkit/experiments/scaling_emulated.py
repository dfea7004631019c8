"""Strong and weak scaling emulated on a GPU cluster (chapter 11): one emulated launch of ``max_world_size``
ranks runs the whole series — for each world size n of it, ranks 0..n-1 form a group and run one data-parallel
training step of the lab's model (forward, backward, one blocking all-reduce of the gradients over the group:
not overlapped), the other ranks wait at the barrier. :mod:`labkit.runtime.emulate` charges each step as a named
model would cost on the cluster, so the curve shows what the laptop cannot: compute shrinking with n (strong)
while the all-reduce does not, and the step up in all-reduce time where the group first crosses a node.

The rows have the columns of :func:`labkit.experiments.scaling.run` (``source`` = the emulation's label) and go
through the same :func:`labkit.experiments.scaling.efficiency`, so every speedup names its baseline.
"""

from __future__ import annotations

import pandas as pd

from labkit.checks import positive_int


def series_sizes(max_world_size: int) -> list[int]:
    """1, 2, 4, ... up to ``max_world_size`` (included even when it is not a power of two)."""
    n = positive_int("max_world_size", max_world_size)
    sizes = [s for s in (1, 2, 4, 8, 16, 32, 64) if s < n]
    return sizes + [n]


def emulated_series_rank(ctx, sizes, strong_total: int, weak_per_rank: int, *, model: str = "lab-tiny-llama",
                         seq_len: int = 32, seed: int = 0) -> dict:
    """Rank function: for each n of ``sizes`` and mode (strong: ``strong_total`` / n sequences per rank; weak:
    ``weak_per_rank``), a barrier, then on ranks < n one timed step ``"<mode> n=<n>"``: forward + backward of
    the lab's model and a blocking all-reduce (average) of the flattened gradients over ranks 0..n-1 (none at
    n = 1). Returns ``{"rank", "cases": [(mode, n, work_per_rank)]}``. Raises ValueError when n does not divide
    ``strong_total``."""
    import torch
    import torch.distributed as dist

    from labkit.models import SyntheticLM, build_model, lm_loss

    net = build_model(model, seed=seed, device=ctx.device)
    data = SyntheticLM(net.spec.vocab_size, seq_len, seed)
    groups = {n: dist.new_group(list(range(n))) for n in sizes if n > 1}  # every rank creates every group
    cases = []
    for mode in ("strong", "weak"):
        for n in sizes:
            work = strong_total // n if mode == "strong" else weak_per_rank
            if mode == "strong" and strong_total % n:
                raise ValueError(f"strong_total={strong_total} does not split over {n} ranks")
            cases.append((mode, n, work))
            ctx.barrier()
            if ctx.rank >= n:
                continue
            tokens, targets = data.batch(ctx.rank, work)  # [work, T]
            net.zero_grad(set_to_none=True)
            with ctx.timer(f"{mode} n={n}"):
                lm_loss(net(tokens.to(ctx.device)), targets.to(ctx.device)).backward()
                if n > 1:
                    flat = torch.cat([p.grad.reshape(-1) for p in net.parameters()])  # [N]
                    dist.all_reduce(flat, group=groups[n])
    return {"rank": ctx.rank, "cases": cases}


def charge(cluster, *, preset: str = "llama-3-8b", seq_len: int = 4096, lab_model: str = "lab-tiny-llama",
           lab_seq_len: int = 32) -> dict:
    """The ``emulate=`` dict charging the series as ``preset`` (one lab sequence = one preset sequence of
    ``seq_len`` tokens; the gradient all-reduce as the preset's parameters in bf16)."""
    return {"cluster": cluster, "model": preset, "seq_len": seq_len, "micro_batch_size": 1, "lab_model": lab_model,
            "lab_seq_len": lab_seq_len, "lab_micro_batch_size": 1}


def cluster_of(profile: str = "dgx-h100", gpus_per_node: int | None = None):
    """``profile`` (a name in data/hardware.yaml) with ``gpus_per_node`` GPUs per node (None: the profile's),
    named ``<profile>/<gpus_per_node>`` when changed."""
    from labkit.theory.cluster import get_cluster

    cl = get_cluster(profile)
    if gpus_per_node is None or int(gpus_per_node) == cl.gpus_per_node:
        return cl
    g = positive_int("gpus_per_node", gpus_per_node)
    return cl.replace(name=f"{cl.name}/{g}", gpus_per_node=g)


def rows_of(emulation, timeline, cases) -> pd.DataFrame:
    """The emulated series as rows of :func:`labkit.experiments.scaling.run` (then :func:`efficiency`): each
    case's step lasts from its first rank's start to its last rank's end on the emulated clock."""
    from labkit.experiments.scaling import efficiency

    frame = emulation.retime(timeline)
    comp = frame[frame["stream"] == "compute"]
    rows = []
    for mode, n, work in cases:
        g = comp[comp["name"] == f"{mode} n={n}"]
        t = float((g["end_ns"].max() - g["start_ns"].min()) / 1e9)
        rows.append({"experiment": "train", "mode": mode, "world_size": n, "work_per_rank": work,
                     "total_work": work * n, "time_s": t, "time_min_s": t, "time_max_s": t, "repeats": 1,
                     "threads_per_rank": 1, "cores": 10**9, "backend": "gloo", "source": emulation.label})
    df = efficiency(pd.DataFrame(rows))
    df.attrs.update(label=emulation.label, gpus_per_node=emulation.cluster.gpus_per_node, frame=frame)
    return df


def run_series(max_world_size: int = 8, cluster="dgx-h100", *, strong_total: int | None = None,
               weak_per_rank: int = 2, preset: str = "llama-3-8b", seq_len: int = 4096,
               lab_model: str = "lab-tiny-llama", lab_seq_len: int = 32, timeout_s: float = 300.0) -> pd.DataFrame:
    """One emulated launch of ``max_world_size`` ranks running :func:`emulated_series_rank` over
    :func:`series_sizes`, charged as ``preset`` on ``cluster`` (a name or a Cluster, e.g. :func:`cluster_of`).
    ``strong_total`` None: 2 x max_world_size sequences. Returns :func:`rows_of` with ``attrs``: ``label``,
    ``gpus_per_node``, ``frame`` (the emulated timeline), ``run`` (to re-price: :func:`reprice`), ``wall_s``
    (measured). Raises ValueError for sizes < 1 or a strong_total that some size does not divide, before any
    launch."""
    from labkit.runtime.launcher import launch

    sizes = series_sizes(max_world_size)
    total = 2 * sizes[-1] if strong_total is None else positive_int("strong_total", strong_total)
    bad = [n for n in sizes if total % n]
    if bad:
        raise ValueError(f"strong_total={total} does not split over world sizes {bad} of the series {sizes}; "
                         f"use a multiple of {sizes[-1]}")
    positive_int("weak_per_rank", weak_per_rank)
    spec = charge(cluster, preset=preset, seq_len=seq_len, lab_model=lab_model, lab_seq_len=lab_seq_len)
    res = launch(emulated_series_rank, sizes[-1], sizes, total, weak_per_rank, model=lab_model, seq_len=lab_seq_len,
                 emulate=spec, echo=False, timeout_s=timeout_s)
    df = rows_of(res.emulation, res.timeline, res[0]["cases"])
    df.attrs.update(run={"emulation": res.emulation, "timeline": res.timeline, "cases": res[0]["cases"],
                         "preset": preset, "seq_len": seq_len, "lab_model": lab_model, "lab_seq_len": lab_seq_len},
                    wall_s=res.wall_s)
    return df


def reprice(df: pd.DataFrame, cluster) -> pd.DataFrame:
    """:func:`run_series`'s series charged on another cluster (a name or Cluster) without running again."""
    r = df.attrs["run"]
    emu = r["emulation"].reprice(charge(cluster, preset=r["preset"], seq_len=r["seq_len"], lab_model=r["lab_model"],
                                        lab_seq_len=r["lab_seq_len"]))
    out = rows_of(emu, r["timeline"], r["cases"])
    out.attrs.update(run={**r, "emulation": emu})
    return out
