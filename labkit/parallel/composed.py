"""Composed (2-D) parallelism on a DeviceMesh built from :class:`labkit.theory.mesh.ParallelDims`, with parity
against the single-process reference.

Three compositions on a 2-D ``DeviceMesh``; two with torch's own ("production") APIs, one from the lab's
hand-written strategy modules:

* ``dp_tp`` — tensor parallelism inside each TP group with ``parallelize_module``
  (:func:`labkit.parallel.tensor.apply_dtensor_tp`; Megatron's split:
  ``wq``/``wk``/``wv`` and ``w_gate``/``w_up`` column-parallel, ``wo`` and ``w_down`` row-parallel, one
  all-reduce after attention and one after the MLP in forward; Shoeybi et al. 2019, Sec. 3; the embedding
  split by vocabulary rows, the output head by vocabulary columns with the logits gathered; norms
  replicated), then FSDP2 ``fully_shard`` of every block and of the root over the DP dimension — the "2-D"
  FSDP + TP of torchtitan (Liang et al. 2024, "TorchTitan", Sec. 3.1). The layout is the one
  labkit.theory.memory assumes, so the measured model-state bytes per rank are compared with its prediction.
* ``dp_tp_hand`` — the same mesh with the lab's hand-written modules on the mesh's process groups:
  :func:`labkit.parallel.tensor.apply_tp` (Megatron TP: vocab-parallel embedding and cross-entropy, column /
  row-parallel linears, explicit ``f``/``g`` autograd functions) over the TP group, wrapped in
  :class:`labkit.parallel.data.DataParallelBucket` (bucketed, overlapped gradient all-reduce) over the DP
  group: replicated data parallelism (ZeRO-0) around tensor parallelism.
* ``pp_dp`` — the layers split into ``pp`` consecutive stages, each stage a ``torch.distributed.pipelining``
  ``PipelineStage`` on the PP group, run with ``Schedule1F1B`` (Narayanan et al. 2021), and each stage
  ``fully_shard``-ed over its DP group (the pipelining runtime drives FSDP's gradient sync on the last
  micro-batch).

The hand-written pipeline runner (labkit.parallel.pipeline.runner) addresses stages by global rank, so PP x DP is
composed with torch's pipelining only.

:func:`composed_rank` runs several compositions in one launch (a launch costs seconds on CPU); each rank also
checks that torch's mesh groups are exactly the groups of :meth:`ParallelDims.groups`. :func:`run_composed`
launches it, trains the single-process reference (:func:`labkit.models.train_reference`, same weights and
batches) and returns the parity table (losses: forward; last-step gradients: backward; final weights: the
updates), the mesh-group check and the measured step times.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from labkit.checks import check_choice, divisors, positive_float, positive_int
from labkit.models import SyntheticLM, build_model, lm_loss, make_optimizer, train_reference
from labkit.parallel.mesh import device_mesh
from labkit.parallel.pipeline.stage import StageModule
from labkit.parallel.tensor.dtensor import apply_dtensor_tp
from labkit.runtime.measure import model_state_bytes
from labkit.runtime.training import local_batch, train_steps
from labkit.theory.mesh import MeshError, ParallelDims, Violation
from labkit.theory.spec import ModelSpec, get_spec

KINDS = ("dp_tp", "dp_tp_hand", "pp_dp")
#: ZeRO stage of each kind's data parallelism (FSDP2 = 3; DataParallelBucket = 0), for the memory prediction
ZERO_OF = {"dp_tp": 3, "dp_tp_hand": 0, "pp_dp": 3}
#: the default runs of a 4-rank launch: DP x TP = 2 x 2 (torch-native and hand-written) and PP x DP = 2 x 2
DEFAULT_RUNS = ({"kind": "dp_tp", "dp": 2, "tp": 2}, {"kind": "dp_tp_hand", "dp": 2, "tp": 2},
                {"kind": "pp_dp", "pp": 2, "dp": 2})


def run_dims(run: dict, world_size: int) -> ParallelDims:
    """The :class:`ParallelDims` of one run dict (``kind`` plus degrees). Raises ValueError (MeshError) when the
    degrees do not multiply to ``world_size`` or the kind is unknown."""
    check_choice("kind", run.get("kind"), KINDS)
    degrees = {k: run.get(k, 1) for k in ("dp", "tp", "pp")}
    if run["kind"] in ("dp_tp", "dp_tp_hand") and degrees["pp"] != 1:
        raise ValueError(f"kind={run['kind']!r} composes dp and tp only, got pp={degrees['pp']}; use kind='pp_dp'")
    if run["kind"] == "pp_dp" and degrees["tp"] != 1:
        raise ValueError(f"kind='pp_dp' composes pp and dp only, got tp={degrees['tp']}; use kind='dp_tp'")
    return ParallelDims(world_size, **degrees)


def check_runs(runs, world_size: int, spec: ModelSpec, *, global_batch_size: int, seq_len: int,
               n_microbatches: int) -> list[ParallelDims]:
    """Validate every run before anything is launched (the ParallelDims rules for ``spec`` and the batch;
    pp_dp needs an untied output head). Raises ValueError naming the run and the fix."""
    out = []
    for run in runs:
        dims = run_dims(run, world_size)
        m = n_microbatches if run["kind"] == "pp_dp" else None
        mbs = global_batch_size // (dims.dp * n_microbatches) if m else global_batch_size // dims.dp
        dims.check(spec, seq_len=seq_len, global_batch_size=global_batch_size, micro_batch_size=max(1, mbs),
                   n_microbatches=m if m else 1)
        if run["kind"] == "dp_tp" and spec.n_kv_heads % dims.tp:
            # ParallelDims accepts replicated kv heads (n_kv_heads | tp), which the hand TP implements; the DTensor
            # plan here shards wk/wv by columns, so it needs whole kv heads per rank
            raise MeshError([Violation("tp_kv_heads", (
                f"kind='dp_tp': tp={dims.tp} does not divide n_kv_heads={spec.n_kv_heads} (the DTensor plan "
                "splits wk/wv by columns, whole kv heads per rank); use kind='dp_tp_hand', which replicates kv "
                f"heads, or tp in {divisors(spec.n_kv_heads)}"))])
        if run["kind"] == "pp_dp" and spec.tied_embeddings:
            raise ValueError(f"kind='pp_dp' needs an untied output head ({spec.name!r} ties it to the embedding, "
                             "which would live on two stages); use a model with tied_embeddings=False, e.g. "
                             "lab-tiny-llama")
        out.append(dims)
    return out


def check_chapter(*, world_size: int, model: str, steps: int, seq_len: int, n_microbatches: int, plan_model: str,
                  plan_gpus: int, plan_gpu: str, gpus_per_node: int, plan_seq_len: int, plan_global_batch: int,
                  timeout_s: float) -> dict:
    """Validate chapter 09's parameters before anything is launched (the chapter's first code cell) and return
    its real runs: ``{"runs", "dp", "global_batch_size"}`` — DP x TP (torch and hand-written) and PP x DP with
    tp = pp = 2 and dp = world_size / 2, ``global_batch_size`` = n_microbatches x dp sequences.

    Raises ValueError naming the value and the fix: world_size odd or < 2 (the 2-D runs put 2 ranks on tp or pp),
    a model or planner GPU that is not a preset, sizes < 1, a mesh the model cannot take (:func:`check_runs`), a
    model this machine's memory cannot hold on world_size ranks, a world that is not a whole number of nodes."""
    from labkit.chapters.common import check_fits_in_memory, check_world_size
    from labkit.theory.planner import DEFAULT_INTER_LINK, Topology

    world_size = check_world_size("09", world_size, why="the 2-D runs put 2 ranks on tp (or pp) and the rest on dp")
    if world_size % 2:
        raise ValueError(f"chapter 09 needs an even world_size (tp or pp = 2, dp = world_size / 2), got "
                         f"world_size={world_size}; use {world_size - 1} or {world_size + 1}")
    for name, value in (("steps", steps), ("seq_len", seq_len), ("n_microbatches", n_microbatches),
                        ("plan_gpus", plan_gpus), ("gpus_per_node", gpus_per_node), ("plan_seq_len", plan_seq_len),
                        ("plan_global_batch", plan_global_batch)):
        positive_int(name, value)
    positive_float("timeout_s", timeout_s)
    spec = get_spec(model)
    get_spec(plan_model)
    Topology.of(plan_gpu, gpus_per_node, DEFAULT_INTER_LINK).check_whole_nodes(plan_gpus, "plan_gpus")
    dp = world_size // 2
    runs = [{"kind": "dp_tp", "dp": dp, "tp": 2}, {"kind": "dp_tp_hand", "dp": dp, "tp": 2},
            {"kind": "pp_dp", "pp": 2, "dp": dp}]
    global_batch_size = n_microbatches * dp  # PP x DP: dp ranks x n_microbatches micro-batches of 1 sequence
    check_runs(runs, world_size, spec, global_batch_size=global_batch_size, seq_len=seq_len,
               n_microbatches=n_microbatches)
    check_fits_in_memory(spec, world_size, copies=2, what="chapter 09's composed runs (and the reference)")
    return {"runs": runs, "dp": dp, "global_batch_size": global_batch_size}


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
    from torch.distributed.fsdp import fully_shard

    # the gathered logits are a view; lm_loss never writes to them in place, so FSDP's warning does not apply
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    model = build_model(spec, seed, device=ctx.device)
    # Megatron's split with torch's parallelize_module, the logits gathered for lm_loss
    apply_dtensor_tp(model, mesh["tp"], gather_logits=True)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = make_optimizer(model.parameters(), lr)
    res = _train(ctx, dims, mesh, model, opt, spec, steps=steps, global_batch_size=global_batch_size, seq_len=seq_len,
                 data_seed=data_seed)
    params = {n: _full(p) for n, p in model.named_parameters()}  # collectives: every rank calls them
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    return _result(ctx, res, model, opt, params, grads, keep=ctx.rank == 0)


class _TPInDP:
    """The harness wrapper protocol (labkit.parallel.harness) for a hand-written TP model inside a hand-written
    DP wrapper: forward through the DP wrapper; after each backward, the DP average (buckets launched during
    backward) and then the sum of TP-partial gradients (none without SP / replicated kv heads)."""

    def __init__(self, dpm, tpm, tp_group):
        self.dpm, self.module, self.tp_group = dpm, tpm, tp_group

    def __call__(self, tokens):
        return self.dpm(tokens)

    def finish_grad_sync(self) -> None:
        from labkit.parallel.tensor import finalize_grads

        self.dpm.finish_grad_sync()
        finalize_grads(self.module, self.tp_group)


def _dp_tp_hand(ctx, dims, mesh, spec, *, steps, global_batch_size, seq_len, lr, seed, data_seed) -> dict:
    from labkit.parallel.data import DataParallelBucket
    from labkit.parallel.tensor import apply_tp, gather_full

    tp_group = mesh.get_group("tp")
    tpm = apply_tp(build_model(spec, seed, device=ctx.device), tp_group)
    dpm = DataParallelBucket(tpm, ctx=ctx, group=mesh.get_group("dp"))
    opt = make_optimizer(tpm.parameters(), lr)
    res = _train(ctx, dims, mesh, _TPInDP(dpm, tpm, tp_group), opt, spec, steps=steps,
                 global_batch_size=global_batch_size, seq_len=seq_len, data_seed=data_seed, loss_fn=tpm.loss)
    params = gather_full(tpm, "param", tp_group)  # collectives over TP: every rank calls them
    grads = gather_full(tpm, "grad", tp_group)
    dpm.close()
    return _result(ctx, res, tpm, opt, params, grads, keep=ctx.rank == 0)


def _train(ctx, dims, mesh, model, opt, spec, *, steps, global_batch_size, seq_len, data_seed, loss_fn=lm_loss):
    """:func:`labkit.parallel.harness.train_steps` on this rank's DP shard of every global batch."""
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
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    coords = dims.coords(ctx.rank)
    stage_idx = coords["pp"]
    model = build_model(spec, seed, device=ctx.device)
    module = StageModule(model, stage_idx, dims.pp)  # labkit.parallel.pipeline's stage: an equal share of layers
    del model
    for layer in module.layers.values():
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(module, mesh=mesh["dp"])
    stage = PipelineStage(module, stage_idx, dims.pp, ctx.device, group=mesh.get_group("pp"))
    schedule = Schedule1F1B(stage, n_microbatches, loss_fn=lm_loss)
    opt = make_optimizer(module.parameters(), lr)
    data = SyntheticLM(spec.vocab_size, seq_len, data_seed)
    losses, step_s = [], []
    ctx.barrier()
    for step in range(steps):
        tk, tg = (t.to(ctx.device) for t in local_batch(data, step, global_batch_size, coords["dp"], dims.dp))
        t0 = time.perf_counter()
        with ctx.timer("pp_dp step", "compute", step=step, stage=stage_idx):
            opt.zero_grad(set_to_none=True)
            mb_losses: list = []
            if module.is_first:
                schedule.step(tk)
            else:
                schedule.step(target=tg, losses=mb_losses)
            opt.step()
        step_s.append(time.perf_counter() - t0)
        if module.is_last:
            losses.append(torch.stack([x.detach() for x in mb_losses]).mean())
    if module.is_last:  # the global mean loss per step, over the last stage's DP group
        lt = torch.stack(losses).double()
        dist.all_reduce(lt, group=mesh.get_group("dp"))
        losses = (lt / dims.dp).tolist()
    params = {n: _full(p) for n, p in module.named_parameters()}  # collectives over DP
    grads = {n: _full(p.grad) for n, p in module.named_parameters()}
    return _result(ctx, {"losses": losses, "step_s": step_s}, module, opt, params, grads, keep=coords["dp"] == 0,
                   stage=stage_idx, losses=module.is_last)


def composed_rank(ctx, runs=DEFAULT_RUNS, *, model: str | ModelSpec = "lab-tiny-llama", steps: int = 2,
                  global_batch_size: int = 8, seq_len: int = 32, n_microbatches: int = 4, lr: float = 1e-3,
                  seed: int = 0, data_seed: int = 0, reference: bool = True) -> list[dict]:
    """Rank function for :func:`labkit.launch`: run each composition of ``runs`` in turn on this rank.

    Per run it builds :meth:`ParallelDims.device_mesh` (torch ``init_device_mesh``), checks that every mesh
    dimension's process group is the :meth:`ParallelDims.groups` group of this rank (raises AssertionError
    if not), trains ``steps`` AdamW steps of the lab model on the global batch (each DP rank its shard; pp_dp
    in ``n_microbatches`` micro-batches per DP rank), and returns one dict per run: ``kind``, ``dims``,
    ``coords``, ``groups`` ({dim: [torch ranks, ParallelDims ranks]}), ``losses`` (global mean per step, on
    the ranks that have it), ``step_s`` (measured seconds per step; the ranks start each run together after a
    barrier), ``model_states`` (measured bytes), and on the ranks that hold a full copy of their part (dp
    rank 0) ``params`` / ``grads`` (full tensors, last step's gradients). dp_tp and dp_tp_hand train with
    :func:`labkit.parallel.harness.train_steps` (its timeline events land in ``ctx.timeline``).
    With ``reference`` rank 0 also returns the single-process reference as the last element
    (``{"kind": "reference", ...}``, :func:`labkit.models.train_reference`).
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
    ``predicted_bytes`` (:func:`predicted_model_states`), ``equal``. ``runs``: the raw per-rank dicts;
    ``wall_s`` the launch's measured wall time.
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


def predicted_model_states(spec: ModelSpec, dims: ParallelDims, stage: int, zero: int = 3) -> dict[str, int]:
    """labkit.theory.memory's prediction of this layout's model states on pipeline rank ``stage``: parameters,
    gradients and AdamW state in fp32 (convention ``torch-fp32``), ZeRO stage ``zero`` over dp (FSDP2 = 3,
    replicated DP = 0), TP-split as :func:`labkit.theory.memory.param_tensors` says. Bytes per rank."""
    from labkit.theory import memory as mem

    est = mem.train_memory(spec, dims.parallel_config(zero=zero), mem.TrainConfig(convention="torch-fp32"),
                           headroom=0.0, workspace_bytes=0, stage=stage)
    return {k: est.categories[k] for k in ("parameters", "gradients", "optimizer")}


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
