"""Composed (2-D) runs on real ranks, with parity against the single-process reference.

:func:`composed_rank` runs several compositions of :mod:`labkit.parallel.composed` in one launch (a launch costs
seconds on CPU): ``dp_tp`` (:func:`~labkit.parallel.composed.apply_dp_tp`: DTensor TP + FSDP2), ``dp_tp_hand``
(:func:`~labkit.parallel.composed.apply_dp_tp_hand`: the lab's TP inside its bucketed DP) and ``pp_dp``
(:class:`~labkit.parallel.composed.PipelineDP`: torch's 1F1B + FSDP2), each on the DeviceMesh of its
:class:`labkit.theory.mesh.ParallelDims` (:func:`labkit.parallel.mesh.device_mesh`); each rank also checks that
torch's mesh groups are exactly the groups of :meth:`ParallelDims.groups`. :func:`run_composed` launches it,
trains the single-process reference (:func:`labkit.models.train_reference`, same weights and batches) and
returns the parity table (losses: forward; last-step gradients: backward; final weights: the updates), the
mesh-group check, the measured step times and the measured model-state bytes beside
:func:`labkit.theory.composed.predicted_model_states`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from labkit.checks import positive_int
from labkit.models import SyntheticLM, build_model, lm_loss, train_reference
from labkit.parallel.composed import PipelineDP, apply_dp_tp, apply_dp_tp_hand
from labkit.parallel.mesh import device_mesh
from labkit.runtime.measure import model_state_bytes
from labkit.runtime.training import local_batch, train_steps
from labkit.theory.composed import ZERO_OF, check_runs, predicted_model_states, run_dims
from labkit.theory.mesh import ParallelDims
from labkit.theory.spec import ModelSpec, get_spec

#: the default runs of a 4-rank launch: DP x TP = 2 x 2 (torch-native and hand-written) and PP x DP = 2 x 2
DEFAULT_RUNS = ({"kind": "dp_tp", "dp": 2, "tp": 2}, {"kind": "dp_tp_hand", "dp": 2, "tp": 2},
                {"kind": "pp_dp", "pp": 2, "dp": 2})


# ------------------------------------------------------------------------------------------------------
# inside a rank
# ------------------------------------------------------------------------------------------------------
def _full(t: torch.Tensor) -> torch.Tensor:
    """A full CPU copy of ``t`` (a DTensor is gathered: a collective every rank of its mesh must call)."""
    from torch.distributed.tensor import DTensor

    # gathering a FSDP x TP parameter takes two all-gathers; torch warns that this is "suboptimal" each time
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def _mesh_groups(mesh, dims: ParallelDims, rank: int) -> dict:
    """{dim: (ranks of torch's group, ranks of ParallelDims' group)} for every mesh dimension."""
    out = {}
    for dim in mesh.mesh_dim_names:
        torch_ranks = sorted(dist.get_process_group_ranks(mesh.get_group(dim)))
        ours = next(g for g in dims.groups(dim) if rank in g)
        out[dim] = (torch_ranks, ours)
    return out


def _dp_tp(ctx, dims, mesh, spec, *, steps, global_batch_size, seq_len, lr, seed, data_seed) -> dict:
    model, opt = apply_dp_tp(build_model(spec, seed, device=ctx.device), mesh, lr=lr)
    res = _train(ctx, dims, mesh, model, opt, spec, steps=steps, global_batch_size=global_batch_size, seq_len=seq_len,
                 data_seed=data_seed)
    params = {n: _full(p) for n, p in model.named_parameters()}  # collectives: every rank calls them
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    return _result(ctx, res, model, opt, params, grads, keep=ctx.rank == 0)


def _dp_tp_hand(ctx, dims, mesh, spec, *, steps, global_batch_size, seq_len, lr, seed, data_seed) -> dict:
    from labkit.parallel.tensor import gather_full

    wrapper, opt = apply_dp_tp_hand(build_model(spec, seed, device=ctx.device), mesh, ctx, lr=lr)
    tpm, tp_group = wrapper.module, wrapper.tp_group
    res = _train(ctx, dims, mesh, wrapper, opt, spec, steps=steps, global_batch_size=global_batch_size,
                 seq_len=seq_len, data_seed=data_seed, loss_fn=tpm.loss)
    params = gather_full(tpm, "param", tp_group)  # collectives over TP: every rank calls them
    grads = gather_full(tpm, "grad", tp_group)
    wrapper.close()
    return _result(ctx, res, tpm, opt, params, grads, keep=ctx.rank == 0)


def _train(ctx, dims, mesh, model, opt, spec, *, steps, global_batch_size, seq_len, data_seed, loss_fn=lm_loss):
    """:func:`labkit.runtime.training.train_steps` on this rank's DP shard of every global batch."""
    return train_steps(ctx, model, opt, SyntheticLM(spec.vocab_size, seq_len, data_seed), steps=steps,
                       global_batch_size=global_batch_size, dp_rank=dims.coords(ctx.rank)["dp"], dp=dims.dp,
                       dp_group=mesh.get_group("dp"), loss_fn=loss_fn, grad_params=[])


def _result(ctx, res, module, opt, params, grads, *, keep: bool, stage: int = 0, losses=True) -> dict:
    """One run's per-rank result: losses, measured step seconds, measured model states, and (``keep``) the
    gathered full params / grads."""
    return {"losses": res["losses"] if losses else None, "step_s": res["step_s"], "stage": stage,
            "model_states": model_state_bytes(module, opt),
            "params": params if keep else None, "grads": grads if keep else None}


def _pp_dp(ctx, dims, mesh, spec, *, steps, global_batch_size, seq_len, lr, seed, data_seed,
           n_microbatches) -> dict:
    coords = dims.coords(ctx.rank)
    pipe = PipelineDP(build_model(spec, seed, device=ctx.device), mesh, stage=coords["pp"],
                      n_microbatches=n_microbatches, device=ctx.device, lr=lr)
    data = SyntheticLM(spec.vocab_size, seq_len, data_seed)
    losses, step_s = [], []
    ctx.barrier()
    for step in range(steps):
        tk, tg = (t.to(ctx.device) for t in local_batch(data, step, global_batch_size, coords["dp"], dims.dp))
        t0 = time.perf_counter()
        with ctx.timer("pp_dp step", "compute", step=step, stage=pipe.stage):
            mb_losses = pipe.step(tk, tg)
        step_s.append(time.perf_counter() - t0)
        if pipe.is_last:
            losses.append(torch.stack([x.detach() for x in mb_losses]).mean())
    if pipe.is_last:  # the global mean loss per step, over the last stage's DP group
        lt = torch.stack(losses).double()
        dist.all_reduce(lt, group=mesh.get_group("dp"))
        losses = (lt / dims.dp).tolist()
    params = {n: _full(p) for n, p in pipe.module.named_parameters()}  # collectives over DP
    grads = {n: _full(p.grad) for n, p in pipe.module.named_parameters()}
    return _result(ctx, {"losses": losses, "step_s": step_s}, pipe.module, pipe.opt, params, grads,
                   keep=coords["dp"] == 0, stage=pipe.stage, losses=pipe.is_last)


def composed_rank(ctx, runs=DEFAULT_RUNS, *, model: str | ModelSpec = "lab-tiny-llama", steps: int = 2,
                  global_batch_size: int = 8, seq_len: int = 32, n_microbatches: int = 4, lr: float = 1e-3,
                  seed: int = 0, data_seed: int = 0, reference: bool = True) -> list[dict]:
    """Rank function for :func:`labkit.launch`: run each composition of ``runs`` in turn on this rank.

    Per run it builds :func:`labkit.parallel.mesh.device_mesh` (torch ``init_device_mesh``), checks that every
    mesh dimension's process group is the :meth:`ParallelDims.groups` group of this rank (raises AssertionError
    if not), trains ``steps`` AdamW steps of the lab model on the global batch (each DP rank its shard; pp_dp
    in ``n_microbatches`` micro-batches per DP rank), and returns one dict per run: ``kind``, ``dims``,
    ``coords``, ``groups`` ({dim: [torch ranks, ParallelDims ranks]}), ``losses`` (global mean per step, on
    the ranks that have it), ``step_s`` (measured seconds per step; the ranks start each run together after a
    barrier), ``model_states`` (measured bytes), and on the ranks that hold a full copy of their part (dp
    rank 0) ``params`` / ``grads`` (full tensors, last step's gradients). dp_tp and dp_tp_hand train with
    :func:`labkit.runtime.training.train_steps` (its timeline events land in ``ctx.timeline``).
    With ``reference`` rank 0 also returns the single-process reference as the last element
    (``{"kind": "reference", ...}``, :func:`labkit.models.train_reference`).
    Raises ValueError for a bad run or size (:func:`labkit.theory.composed.check_runs`), before any step.
    """
    spec = get_spec(model) if isinstance(model, str) else model
    check_runs(runs, ctx.world_size, spec, global_batch_size=global_batch_size, seq_len=seq_len,
               n_microbatches=n_microbatches)
    common = dict(steps=positive_int("steps", steps), global_batch_size=global_batch_size, seq_len=seq_len, lr=lr,
                  seed=seed, data_seed=data_seed)
    out = []
    for run in runs:
        dims = run_dims(run, ctx.world_size)
        mesh = device_mesh(dims, ctx.device.type)
        groups = _mesh_groups(mesh, dims, ctx.rank)
        for dim, (theirs, ours) in groups.items():
            assert theirs == ours, f"mesh dim {dim}: torch group {theirs} != ParallelDims group {ours}"
        if run["kind"] == "dp_tp":
            res = _dp_tp(ctx, dims, mesh, spec, **common)
        elif run["kind"] == "dp_tp_hand":
            res = _dp_tp_hand(ctx, dims, mesh, spec, **common)
        else:
            res = _pp_dp(ctx, dims, mesh, spec, n_microbatches=n_microbatches, **common)
        out.append({"kind": run["kind"], "dims": dims.to_dict(), "coords": dims.coords(ctx.rank),
                    "groups": {k: [list(a), list(b)] for k, (a, b) in groups.items()}, **res})
        ctx.barrier()
    if reference and ctx.rank == 0:
        ref = train_reference(spec, steps=steps, global_batch_size=global_batch_size, seq_len=seq_len, lr=lr,
                              seed=seed, data_seed=data_seed, return_grads=True)
        out.append({"kind": "reference", "losses": ref["losses"], "params": ref["state_dict"],
                    "grads": ref["grads"], "seconds": ref["seconds"], "steps": steps, "lr": lr})
    return out


# ------------------------------------------------------------------------------------------------------
# in the caller
# ------------------------------------------------------------------------------------------------------
@dataclass
class ComposedResult:
    """What :func:`run_composed` returns.

    ``parity``: one row per run and quantity (``losses``, ``grads``, ``params``): ``max_abs_diff``,
    ``max_rel_diff`` (against the reference), ``tensors`` compared, ``rtol``/``atol`` (models.TOLERANCES fp32;
    weights after the AdamW steps get 0.1·lr per step more atol, see :func:`compare`) and ``ok``
    (torch.testing.assert_close passed). ``groups``: one row per run and mesh dimension and rank:
    torch's group, ParallelDims' group, ``same``. ``timing``: measured seconds per step (median over ranks
    and steps after the first) per run, and the single-process reference's. ``memory``: one row per run, rank
    and model-state category: ``measured_bytes`` (labkit.runtime.measure.model_state_bytes after the last step),
    ``predicted_bytes`` (:func:`labkit.theory.composed.predicted_model_states`), ``equal``. ``runs``: the raw
    per-rank dicts; ``wall_s`` the launch's measured wall time.
    """

    parity: object
    groups: object
    timing: object
    memory: object
    runs: list = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.parity["ok"].all()) and bool(self.groups["same"].all())


def _merge(parts: list[dict | None]) -> dict:
    full = {}
    for p in parts:
        for k, v in (p or {}).items():
            if k in full:
                raise ValueError(f"parameter {k!r} returned by two ranks of one dp replica")
            full[k] = v
    return full


def compare(per_rank: list[list[dict]], spec: ModelSpec | str = "lab-tiny-llama", dtype: torch.dtype = torch.float32):
    """Parity, group, timing and memory tables (pandas) from :func:`composed_rank` results (one list per rank,
    rank 0's ending with the reference) for model ``spec``. Uses models.TOLERANCES[dtype]. Raises ValueError
    for an unknown model preset."""
    import pandas as pd

    from labkit.models import TOLERANCES

    spec = get_spec(spec) if isinstance(spec, str) else spec
    memory = []
    tol = TOLERANCES[dtype]
    ref = per_rank[0][-1]
    if ref.get("kind") != "reference":
        raise ValueError("rank 0's results carry no reference; run composed_rank with reference=True")
    n_runs = len(per_rank[0]) - 1
    parity, groups, timing = [], [], []
    for i in range(n_runs):
        rows = [r[i] for r in per_rank]
        kind = rows[0]["kind"]
        degrees = ", ".join(f"{k}={rows[0]['dims'][k]}" for k in ("dp", "tp", "pp") if rows[0]["dims"][k] > 1)
        label = f"{kind} ({degrees})"
        losses = next(r["losses"] for r in rows if r.get("losses") is not None)
        got = {"losses": {"losses": torch.tensor(losses, dtype=torch.float64)},
               "grads": _merge([r["grads"] for r in rows]), "params": _merge([r["params"] for r in rows])}
        want = {"losses": {"losses": torch.tensor(ref["losses"], dtype=torch.float64)}, "grads": ref["grads"],
                "params": {k: v for k, v in ref["params"].items() if k in ref["grads"]}}
        for what in ("losses", "grads", "params"):
            g, w = got[what], want[what]
            # Adam divides each gradient by its running RMS: where a gradient is near eps, a rounding-level
            # difference can move that element's update by up to lr, so weights get 0.1 * lr per step on top
            # (the convention of labkit.experiments.tensor's parity checks); losses and gradients get fp32's own.
            t = dict(tol, atol=tol["atol"] + 0.1 * ref["lr"] * ref["steps"]) if what == "params" else tol
            ok, err = set(g) == set(w), ""
            abs_d = rel_d = 0.0
            if not ok:
                err = f"names differ: missing {sorted(set(w) - set(g))[:3]}, extra {sorted(set(g) - set(w))[:3]}"
            for k in sorted(set(g) & set(w)):
                a, b = g[k].double(), w[k].double()
                if a.shape != b.shape:
                    ok, err = False, f"{k}: shape {tuple(a.shape)} != {tuple(b.shape)}"
                    continue
                d = (a - b).abs()
                abs_d = max(abs_d, float(d.max()))
                rel_d = max(rel_d, float((d / b.abs().clamp_min(t["atol"])).max()))
                try:
                    torch.testing.assert_close(g[k].float(), w[k].float(), **t)
                except AssertionError as e:
                    ok, err = False, f"{k}: {str(e).splitlines()[0]}"
            parity.append({"run": label, "what": what, "tensors": len(set(g) & set(w)), "max_abs_diff": abs_d,
                           "max_rel_diff": rel_d, "rtol": t["rtol"], "atol": t["atol"], "ok": ok, "error": err})
        for rank, r in enumerate(rows):
            for dim, (theirs, ours) in r["groups"].items():
                groups.append({"run": label, "rank": rank, "dim": dim, "torch_group": theirs,
                               "parallel_dims_group": ours, "same": theirs == ours})
        dims = ParallelDims(**{k: v for k, v in rows[0]["dims"].items() if k != "order"})
        for rank, r in enumerate(rows):
            pred = predicted_model_states(spec, dims, r["stage"], ZERO_OF[kind])
            for cat, measured in r["model_states"].items():
                memory.append({"run": label, "rank": rank, "stage": r["stage"], "category": cat,
                               "measured_bytes": measured, "predicted_bytes": pred[cat],
                               "equal": measured == pred[cat]})
        warm = len(rows[0]["step_s"]) > 1  # the first step (warm-up) is left out when there is another
        steps = [s for r in rows for s in (r["step_s"][1:] if warm else r["step_s"])]
        timing.append({"run": label, "step_s": float(torch.tensor(steps).median()), "statistic": "median",
                       "step_s_min": min(steps), "step_s_max": max(steps), "ranks": len(rows),
                       "note": "measured, ranks started together, " + (
                           "first step (warm-up) excluded" if warm else "the only step: includes warm-up")})
    timing.append({"run": "reference (1 process)", "step_s": ref["seconds"] / ref["steps"], "statistic": "mean",
                   "step_s_min": None, "step_s_max": None, "ranks": 1,
                   "note": f"measured, wall time of all {ref['steps']} steps of train_reference / {ref['steps']} "
                           "(includes the first)"})
    return pd.DataFrame(parity), pd.DataFrame(groups), pd.DataFrame(timing), pd.DataFrame(memory)


def run_composed(world_size: int = 4, runs=DEFAULT_RUNS, *, model: str | ModelSpec = "lab-tiny-llama",
                 steps: int = 2, global_batch_size: int = 8, seq_len: int = 32, n_microbatches: int = 4,
                 lr: float = 1e-3, seed: int = 0, data_seed: int = 0, backend: str = "gloo",
                 timeout_s: float = 300.0) -> ComposedResult:
    """Launch :func:`composed_rank` on ``world_size`` ranks (every run's degrees must multiply to it) and compare
    with the single-process reference. Validates every run first (ValueError naming the fix, before any
    process starts). Returns a :class:`ComposedResult`. Raises ValueError for bad runs or sizes, before any
    process starts; labkit.runtime.launcher.LaunchError when a rank fails or the launch times out."""
    from labkit.runtime.launcher import launch

    spec = get_spec(model) if isinstance(model, str) else model
    check_runs(runs, positive_int("world_size", world_size), spec, global_batch_size=global_batch_size,
               seq_len=seq_len, n_microbatches=n_microbatches)
    res = launch(composed_rank, world_size, list(runs), model=spec, steps=steps, global_batch_size=global_batch_size,
                 seq_len=seq_len, n_microbatches=n_microbatches, lr=lr, seed=seed, data_seed=data_seed,
                 backend=backend, timeout_s=timeout_s)
    parity, groups, timing, memory = compare(list(res), spec)
    return ComposedResult(parity, groups, timing, memory, list(res), res.wall_s)
