"""The hand-written strategies in a plain training loop, with torch's idioms (issue 15), on gloo at world sizes
2 and 3 (uneven shards: every unit of the test model is padded at 3 ranks, and at 2 the root is):

* frozen parameters (``requires_grad=False``) never change under AdamW with weight decay — ZeRO-1/2/3 and FSDP2
  beside them, ShardedOptimizer on every DDP (field case "frozen parameters");
* ``zero_grad`` of the wrapper or of the optimizer, ``set_to_none`` True or False, between steps of every ZeRO
  stage: the next step works and the run equals the one-process reference; after the wrapper's ``zero_grad()``
  every ``.grad`` is None (field case "torch zero_grad");
* ``ShardedOptimizer(params, torch.optim.AdamW, **kw)`` with param groups on the lab's two DDPs and torch DDP:
  parity with unsharded AdamW + weight decay after 10 steps, the partition equal to torch's
  ZeroRedundancyOptimizer's, state bytes per rank equal to labkit.theory.zero / labkit.theory.memory;
* hand FSDP: every module parameter's ``.grad`` after the sync is its local shard (a 1-D view of the shard's
  gradient), equal to the matching part of the reference gradient; ``clip_grad_norm_`` equals torch's on the
  reference, FSDP2 beside; mixed precision (bf16 / fp16 parameters, fp32 / fp16 reduction) beside FSDP2 with the
  same MixedPrecisionPolicy;
* DDP wrappers: options keyword-only, ``bucket_cap_mb`` (None = one bucket), a forward through ``.module``
  still synchronised (torch DDP's own behaviour — no sync — shown beside).

Every loop here is the user's: forward, ``loss.backward()``, ``optimizer.step()``; no lab call in between.
Tolerances: fp32 ``labkit.models.TOLERANCES[fp32]`` (rtol 1e-4, atol 1e-5) against the reference; mixed
precision in :data:`MP_TOL`.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from labkit import launch
from labkit.models import TOLERANCES

STEPS, GLOBAL_BATCH, LR, WD = 10, 12, 0.05, 0.1
FROZEN = 2.0
FP32 = TOLERANCES[torch.float32]
#: mixed precision, (param_dtype, reduce_dtype) -> tolerance of the final fp32 master weights after STEPS steps,
#: hand-written ZeRO-3 vs FSDP2 with the same policy and each vs the one-process reference with the same policy
#: (parameters cast to param_dtype for forward/backward, gradients in param_dtype then reduce_dtype, fp32 AdamW)
MP_TOL = {("bfloat16", "float32"): {"rtol": 2e-2, "atol": 2e-2},
          ("float16", "float16"): {"rtol": 5e-3, "atol": 5e-3}}


# ------------------------------------------------------------------------------------------------------
# the user's model, data and loop
# ------------------------------------------------------------------------------------------------------
class Layer(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)
        self.gate = nn.Parameter(torch.full((d,), FROZEN), requires_grad=False)  # frozen, inside a unit

    def forward(self, h):
        return h + torch.tanh(self.lin(self.norm(h))) * self.gate  # (b, d)


class Net(nn.Module):
    """Root: inp (7·10 + 10) + head (10·3 + 3) = 113 trainable; each layer 130 trainable; two frozen."""

    def __init__(self, d_in: int = 7, d: int = 10, n_layers: int = 2, d_out: int = 3):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.layers = nn.ModuleList(Layer(d) for _ in range(n_layers))
        self.head = nn.Linear(d, d_out)
        self.scale = nn.Parameter(torch.full((d_out,), FROZEN), requires_grad=False)  # frozen, in the root

    def forward(self, x):
        h = self.inp(x)  # (b, d)
        for layer in self.layers:
            h = layer(h)
        return self.head(h) * self.scale  # (b, d_out)


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 7, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def groups_of(model: nn.Module) -> list[dict]:
    """Param groups as people write them: weight decay on matrices, none on biases and norms."""
    named = [(n, p) for n, p in model.named_parameters()]
    return [{"params": [p for n, p in named if p.ndim >= 2]},
            {"params": [p for n, p in named if p.ndim < 2], "weight_decay": 0.0}]


def adamw(params, **kw):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=WD, foreach=False, **kw)


def user_loop(model, opt, rank: int, n: int, *, steps: int = STEPS, m: int = 1, zero=None, no_sync=None,
              clip=None, via_module: bool = False) -> list:
    """forward, backward, (clip,) step — the user's loop on this rank's share of each global batch. ``zero``:
    how gradients are reset before each step; ``no_sync``: the wrapper's, around every micro-batch but the last.
    Returns the clip norms."""
    norms = []
    fwd = model.module if via_module else model
    for step in range(steps):
        (zero or (lambda: opt.zero_grad()))()
        x, y = batch(step)
        x, y = x.chunk(n)[rank], y.chunk(n)[rank]
        for i, (xb, yb) in enumerate(zip(x.chunk(m), y.chunk(m))):
            cm = no_sync() if (no_sync is not None and i < m - 1) else contextlib.nullcontext()
            with cm:
                loss = F.mse_loss(fwd(xb).float(), yb) / m
                loss.backward()
        if clip is not None:
            norms.append(float(clip()))
        opt.step()
    return norms


def reference(*, groups: bool = False, clip: float | None = None, steps: int = STEPS, mp=None) -> dict:
    """One process, the global batch, unsharded AdamW. ``mp`` (param_dtype, reduce_dtype names): forward and
    backward on a copy in param_dtype, gradients cast to fp32 for the fp32 master weights."""
    master = make_net()
    opt = adamw(groups_of(master) if groups else master.parameters())
    pdtype = None if mp is None else getattr(torch, mp[0])
    work = None if mp is None else copy.deepcopy(master).to(pdtype)
    norms, first_grads = [], None
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(step)
        if work is None:
            F.mse_loss(master(x), y).backward()
        else:
            with torch.no_grad():
                for pw, pm in zip(work.parameters(), master.parameters()):
                    pw.copy_(pm)
            work.zero_grad()
            F.mse_loss(work(x.to(pdtype)).float(), y).backward()
            for pw, pm in zip(work.parameters(), master.parameters()):
                pm.grad = None if pw.grad is None else pw.grad.float()
        if first_grads is None:
            first_grads = {k: p.grad.clone() for k, p in master.named_parameters() if p.grad is not None}
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(master.parameters(), clip)))
        opt.step()
    return {"state": {k: v.detach().clone() for k, v in master.state_dict().items()}, "norms": norms,
            "grads": first_grads}


# ------------------------------------------------------------------------------------------------------
# what each rank runs
# ------------------------------------------------------------------------------------------------------
def _state(model) -> dict:
    if hasattr(model, "full_state_dict"):
        return model.full_state_dict()
    sd = getattr(model, "module", model).state_dict()
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone() for k, v in sd.items()}


def _all_grads_none(z) -> bool:
    return all(p.grad is None for p in list(z.module.parameters()) + z.optim_parameters())


def zero_runs(ctx) -> dict:
    """ZeRO-1/2/3 with weight decay and frozen parameters, every way of zeroing gradients, accumulation."""
    from labkit.parallel.zero import ZeroDataParallel

    r, n = ctx.rank, ctx.world_size
    out = {}
    for stage in (1, 2, 3):
        for mode in ("wrapper-none", "wrapper-zeros", "optimizer-none", "optimizer-zeros", "never-after-first"):
            z = ZeroDataParallel(make_net(), stage)
            opt = adamw(z.optim_parameters())
            zero = {"wrapper-none": lambda z=z: z.zero_grad(), "wrapper-zeros": lambda z=z: z.zero_grad(False),
                    "optimizer-none": lambda o=opt: o.zero_grad(set_to_none=True),
                    "optimizer-zeros": lambda o=opt: o.zero_grad(set_to_none=False),
                    "never-after-first": lambda: None}[mode]
            user_loop(z, opt, r, n, zero=zero, steps=STEPS if mode != "never-after-first" else 2)
            row = {"state": _state(z)}
            z.zero_grad()
            row["grads_none_after_zero_grad"] = _all_grads_none(z)
            out[(stage, mode)] = row
            z.close()
        # accumulation over 2 micro-batches: stage 1 with no_sync, stages 2-3 syncing each micro-batch
        z = ZeroDataParallel(make_net(), stage)
        opt = adamw(z.optim_parameters())
        user_loop(z, opt, r, n, m=2, zero=z.zero_grad, no_sync=z.no_sync if stage == 1 else None)
        out[(stage, "acc")] = {"state": _state(z)}
        z.close()
        if stage == 1:  # no no_sync: every micro-batch synchronises, and the shard gradient accumulates
            z = ZeroDataParallel(make_net(), 1)
            opt = adamw(z.optim_parameters())
            user_loop(z, opt, r, n, m=2, zero=z.zero_grad)
            out[(1, "acc-sync-each")] = {"state": _state(z)}
            z.close()
    # torch's first idiom: the optimizer over model.parameters() (one set: the shards and what stays whole)
    for stage in (1, 2, 3):
        z = ZeroDataParallel(make_net(), stage)
        opt = adamw(z.parameters())
        user_loop(z, opt, r, n)
        out[(stage, "model-parameters")] = {"state": _state(z), "names": [q for q, _ in z.named_parameters()]}
        z.close()
    # ignored_params: kept whole and replicated (gradients averaged), the rest sharded
    for stage in (1, 2, 3):
        net = make_net()
        keep = [net.inp.weight]
        z = ZeroDataParallel(net, stage, ignored_params=keep)
        opt = adamw(z.parameters())
        user_loop(z, opt, r, n)
        out[(stage, "ignored")] = {"state": _state(z), "kept_whole": tuple(net.inp.weight.shape),
                                   "in_a_unit": any(p is net.inp.weight for u in z.units for p in u.params)}
        z.close()
    # the wrong optimizer: a clear error at the first step
    errors = {}
    for stage, params in ((1, "module"), (2, "module"), (3, "both")):
        z = ZeroDataParallel(make_net(), stage)
        opt = adamw(list(z.module.parameters()) + (z.optim_parameters() if params == "both" else []))
        try:
            user_loop(z, opt, r, n, steps=1)
        except ValueError as e:
            errors[stage] = str(e)
        z.close()
    out["errors"] = errors
    # stage 3, the optimizer over the module's parameters (each a view of its part of the shard), param groups
    net = make_net()
    groups = groups_of(net)  # by shape, so before wrapping: at stage 3 the parameters become 1-D local shards
    z = ZeroDataParallel(net, 3)
    opt = adamw(groups)
    user_loop(z, opt, r, n)
    out[(3, "module-param-groups")] = {"state": _state(z)}
    z.close()
    return out


def fsdp2_runs(ctx) -> dict:
    """FSDP2 beside: the same model, frozen parameters, weight decay; torch's clip_grad_norm_ on DTensors."""
    from torch.distributed.fsdp import fully_shard

    r, n = ctx.rank, ctx.world_size
    out = {}
    for clip in (None, 0.5):
        model = make_net()
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = adamw(model.parameters())
        c = None if clip is None else (lambda m=model, c=clip: torch.nn.utils.clip_grad_norm_(m.parameters(), c))
        norms = user_loop(model, opt, r, n, clip=c)
        out[clip] = {"state": _state(model), "norms": [float(x) for x in norms]}
    return out


def fsdp_grad_runs(ctx) -> dict:
    """Hand FSDP (stage 3): the module parameters' gradients after the sync, clipping, inspection."""
    from labkit.parallel.zero import ZeroDataParallel

    r, n = ctx.rank, ctx.world_size
    z = ZeroDataParallel(make_net(), 3)
    x, y = batch(0)
    F.mse_loss(z(x.chunk(n)[r]), y.chunk(n)[r]).backward()
    local = {}
    for u in z.units:
        for q, p, o, (a, b) in zip(u.names, u.params, u.offsets, u.pieces):
            start = max(r * u.k + a - o, 0)  # this rank's part of p, in p's flattened elements
            local[q] = {"grad": None if p.grad is None else p.grad.clone(), "range": (start, start + b - a),
                        "shape": tuple(p.shape),
                        "is_view": p.grad is not None and p.grad.data_ptr() == u.shard.grad[a:b].data_ptr()}
    full = z.full_grads()
    inf_norm = float(z.clip_grad_norm_(1e9, norm_type=float("inf")))  # no clipping at this max_norm
    z.close()
    z = ZeroDataParallel(make_net(), 3)
    opt = adamw(z.optim_parameters())
    norms = user_loop(z, opt, r, n, clip=lambda: z.clip_grad_norm_(0.5))
    out = {"local": local, "full": full, "inf_norm": inf_norm,
           "clip": {"state": _state(z), "norms": [float(x) for x in norms]}}
    z.close()
    return out


def mp_runs(ctx) -> dict:
    """Mixed precision: the hand-written ZeRO-3 and FSDP2 with one MixedPrecisionPolicy each."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from labkit.parallel.zero import ZeroDataParallel

    r, n = ctx.rank, ctx.world_size
    out = {}
    for pd, rd in MP_TOL:
        policy = MixedPrecisionPolicy(param_dtype=getattr(torch, pd), reduce_dtype=getattr(torch, rd))
        z = ZeroDataParallel(make_net(), 3, mp_policy=policy)
        opt = adamw(z.optim_parameters())
        user_loop(z, opt, r, n)
        dtypes = {"shard": str(z.units[0].shard.dtype), "flat": str(z.units[0].flat.dtype)}
        hand = _state(z)
        z.close()
        model = make_net()
        for layer in model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        opt = adamw(model.parameters())
        user_loop(model, opt, r, n)
        out[(pd, rd)] = {"hand": hand, "fsdp2": _state(model), "dtypes": dtypes}
    return out


def sharded_optimizer_runs(ctx) -> dict:
    """ShardedOptimizer (ZeRO-1) with param groups on the lab's DDPs and torch DDP; torch's
    ZeroRedundancyOptimizer beside; state bytes of lab-tiny-llama per rank."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from labkit.parallel.data import DataParallelBucket, DataParallelNaive, torch_ddp
    from labkit.parallel.zero import ShardedOptimizer

    r, n = ctx.rank, ctx.world_size
    out = {}
    wrappers = {"naive": lambda m: DataParallelNaive(m), "bucket": lambda m: DataParallelBucket(m, bucket_cap_mb=None),
                "ddp": lambda m: torch_ddp(m, log_comm=False)}
    kw = {"lr": LR, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": WD, "foreach": False}
    for name, wrap in wrappers.items():
        model = wrap(make_net())
        opt = ShardedOptimizer(groups_of(model.module), torch.optim.AdamW, **kw)
        user_loop(model, opt, r, n)
        owned = [q for q, p in model.module.named_parameters() if opt.owner.get(p) == r]
        out[name] = {"state": _state(model), "owned": owned}
    # torch's ZeroRedundancyOptimizer beside (trainable parameters: torch's partition also counts frozen ones)
    model = torch_ddp(make_net(), log_comm=False)
    trainable = [p for p in model.module.parameters() if p.requires_grad]
    zro = ZeroRedundancyOptimizer(trainable, optimizer_class=torch.optim.AdamW, **kw)
    mine = ShardedOptimizer(trainable, torch.optim.AdamW, **kw)
    names = {p: q for q, p in model.module.named_parameters()}
    out["partition"] = {"torch": [[names[p] for g in per_rank for p in g["params"]]
                                  for per_rank in zro._partition_parameters()],
                        "lab": [[names[p] for p in mine.owned_parameters(k)] for k in range(n)]}
    user_loop(model, zro, r, n)
    out["zero_redundancy"] = {"state": _state(model)}
    # an LR scheduler on the full param_groups reaches the local optimizer
    model = DataParallelNaive(make_net())
    opt = ShardedOptimizer(model.module.parameters(), torch.optim.AdamW, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    user_loop(model, opt, r, n, steps=1)
    sched.step()
    user_loop(model, opt, r, n, steps=1)
    out["lr"] = {"full": opt.param_groups[0]["lr"], "local": opt.local_optimizer().param_groups[0]["lr"]
                 if opt.local_optimizer() else None}
    # state bytes of the lab's model after one step
    from labkit.models import SyntheticLM, build_model, lm_loss
    from labkit.runtime.measure import model_state_bytes

    model = DataParallelBucket(build_model("lab-tiny-llama"))
    opt = ShardedOptimizer(model.module.parameters(), torch.optim.AdamW, lr=1e-3)
    tokens, targets = SyntheticLM(256, 16).batch(0, 2 * n)
    lm_loss(model(tokens.chunk(n)[r]), targets.chunk(n)[r]).backward()
    opt.step()
    out["bytes"] = model_state_bytes(model.module, opt)
    out["bytes"]["n_state"] = len(opt.state)
    return out


def ddp_runs(ctx) -> dict:
    """DDP wrappers: buckets from bucket_cap_mb, one bucket for None, a forward through .module."""
    from labkit.parallel.data import DataParallelBucket, DataParallelNaive, torch_ddp

    r, n = ctx.rank, ctx.world_size
    out = {}
    net = make_net()
    trainable_bytes = sum(p.numel() * 4 for p in net.parameters() if p.requires_grad)
    out["buckets"] = {str(cap): len(DataParallelBucket(make_net(), bucket_cap_mb=cap).buckets)
                      for cap in (None, 25.0, 400 / 2**20)}
    out["trainable_bytes"] = trainable_bytes
    wrapped = DataParallelBucket(net, bucket_cap_mb=None)
    out["module_kept"] = wrapped.module is net
    x, y = batch(0)
    xb, yb = x.chunk(n)[r], y.chunk(n)[r]
    grads = {}
    for name, wrap in (("naive", DataParallelNaive), ("bucket", DataParallelBucket),
                       ("bucket-one", lambda m: DataParallelBucket(m, bucket_cap_mb=None)),
                       ("ddp", lambda m: torch_ddp(m, log_comm=False))):
        for via in ("wrapper", "module"):
            model = wrap(make_net())
            fwd = model if via == "wrapper" else model.module
            F.mse_loss(fwd(xb), yb).backward()
            grads[(name, via)] = {q: p.grad.clone() for q, p in model.module.named_parameters() if p.grad is not None}
            if hasattr(model, "close"):
                model.close()
    out["grads"] = grads
    # one bucket: one all-reduce per step (counted by a CommLog-free probe: wrap dist.all_reduce)
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: (calls.append(t.numel()), real(t, *a, **k))[1]
    try:
        model = DataParallelBucket(make_net(), bucket_cap_mb=None)
        F.mse_loss(model(xb), yb).backward()
        ddp = torch_ddp(make_net(), bucket_cap_mb=None)
        F.mse_loss(ddp(xb), yb).backward()
    finally:
        dist.all_reduce = real
    out["one_bucket_calls"] = calls
    return out


def idioms_rank(ctx) -> dict:
    torch.manual_seed(1234 + ctx.rank)  # replicas start different; the wrappers broadcast rank 0's weights
    return {"zero": zero_runs(ctx), "fsdp2": fsdp2_runs(ctx), "fsdp_grads": fsdp_grad_runs(ctx), "mp": mp_runs(ctx),
            "sharded": sharded_optimizer_runs(ctx), "ddp": ddp_runs(ctx)}


# ------------------------------------------------------------------------------------------------------
# fixtures
# ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def launched(request):
    n = request.param
    return n, launch(idioms_rank, n, timeout_s=600)


@pytest.fixture(scope="module")
def ref():
    return reference()


def _close(actual: dict, expected: dict, what: str, tol=FP32) -> float:
    """assert_close per entry; returns the max |diff|."""
    assert set(actual) == set(expected), what
    worst = 0.0
    for k in expected:
        torch.testing.assert_close(actual[k].float(), expected[k].float(), **tol, msg=lambda m, k=k: f"{what} {k}: {m}")
        worst = max(worst, float((actual[k].float() - expected[k].float()).abs().max()))
    return worst


def _frozen_unchanged(state: dict, what: str) -> None:
    for k, v in state.items():
        if k.endswith("scale") or k.endswith("gate"):
            assert torch.equal(v, torch.full_like(v, FROZEN)), f"{what}: frozen {k} changed to {v}"


# ------------------------------------------------------------------------------------------------------
# frozen parameters and zero_grad
# ------------------------------------------------------------------------------------------------------
def test_reference_decays_what_it_may_and_not_the_frozen():
    """The reference itself: weight decay moves the trainable weights, the frozen ones stay at 2.0."""
    out = reference()
    _frozen_unchanged(out["state"], "reference")
    assert not torch.equal(out["state"]["head.weight"], make_net().head.weight.detach())


def test_zero_stages_frozen_parameters_never_change(launched, ref):
    """Field case "frozen parameters": AdamW with weight decay 0.1, 10 steps; before the fix ZeRO packed the
    frozen parameters into its shards and decayed them (2.0 -> 1.8088 at lr 0.1)."""
    n, res = launched
    for rank_res in res:
        for key, row in rank_res["zero"].items():
            if key != "errors":
                _frozen_unchanged(row["state"], f"zero{key}")
        for clip, row in rank_res["fsdp2"].items():
            _frozen_unchanged(row["state"], f"fsdp2 clip={clip}")
        for name in ("naive", "bucket", "ddp", "zero_redundancy"):
            _frozen_unchanged(rank_res["sharded"][name]["state"], f"ShardedOptimizer on {name}")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_every_zero_grad_form_trains_like_the_reference(launched, ref, stage):
    """Field case "torch zero_grad": the wrapper's or the optimizer's zero_grad, set_to_none True or False,
    between steps: 10 steps equal the reference (weights, every rank the same)."""
    n, res = launched
    for mode in ("wrapper-none", "wrapper-zeros", "optimizer-none", "optimizer-zeros"):
        states = [r["zero"][(stage, mode)]["state"] for r in res]
        for s in states[1:]:
            assert all(torch.equal(s[k], states[0][k]) for k in s), (stage, mode)
        _close(states[0], ref["state"], f"ZeRO-{stage} {mode}")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_grad_default_leaves_grad_none(launched, stage):
    """After the wrapper's zero_grad() every .grad (module parameters and shards) is None, as torch's default."""
    n, res = launched
    for r in res:
        for mode in ("wrapper-none", "optimizer-none", "optimizer-zeros", "wrapper-zeros"):
            assert r["zero"][(stage, mode)]["grads_none_after_zero_grad"], (stage, mode)


def test_never_zeroing_accumulates_like_torch(launched):
    """Without zero_grad between steps torch accumulates .grad; every stage does the same (2 steps)."""
    n, res = launched
    want = _accumulating_reference(2)
    for stage in (1, 2, 3):
        _close(res[0]["zero"][(stage, "never-after-first")]["state"], want, f"ZeRO-{stage} never zeroed")


def _accumulating_reference(steps):
    master = make_net()
    opt = adamw(master.parameters())
    for step in range(steps):
        if step == 0:
            opt.zero_grad()
        x, y = batch(step)
        F.mse_loss(master(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in master.state_dict().items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accumulation_in_a_plain_loop(launched, ref, stage):
    """Two micro-batches per step (stage 1 with no_sync, 2-3 syncing each one; stage 1 also without no_sync)."""
    n, res = launched
    _close(res[0]["zero"][(stage, "acc")]["state"], ref["state"], f"ZeRO-{stage} accumulation")
    if stage == 1:
        _close(res[0]["zero"][(1, "acc-sync-each")]["state"], ref["state"], "ZeRO-1 sync on each micro-batch")


def test_wrong_optimizer_parameters_are_a_clear_error(launched):
    n, res = launched
    errors = res[0]["zero"]["errors"]
    assert "build it over model.parameters()" in errors[1] and "stage=1" in errors[1]
    assert "the module's parameter 'inp.weight'" in errors[2]
    assert "both the flat shards and the module's parameters" in errors[3] and "model.module.parameters()" in errors[3]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizer_over_model_parameters_as_in_torch(launched, ref, stage):
    """``AdamW(model.parameters())`` — torch FSDP's first idiom — trains as the reference at every stage, and
    ``named_parameters`` holds the shards once and no view into them."""
    n, res = launched
    row = res[0]["zero"][(stage, "model-parameters")]
    _close(row["state"], ref["state"], f"ZeRO-{stage} over model.parameters()")
    assert row["names"] and all(q.startswith("shards.") or q.startswith("module.") for q in row["names"])
    assert not any(q == "module.inp.weight" for q in row["names"])  # sharded: only its shard is yielded


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ignored_params_stay_whole_and_replicated(launched, ref, stage):
    """``ignored_params`` (FSDP2's name): the parameter is never in a unit, keeps its shape, and its averaged
    gradient keeps every replica equal to the reference (a missing all-reduce would leave each rank's own)."""
    n, res = launched
    row = res[0]["zero"][(stage, "ignored")]
    assert not row["in_a_unit"] and len(row["kept_whole"]) == 2
    for r in range(n):
        _close(res[r]["zero"][(stage, "ignored")]["state"], ref["state"], f"ZeRO-{stage} ignored_params rank {r}")


def test_stage3_optimizer_over_module_parameters_with_groups(launched):
    """Hand FSDP with AdamW(param groups of model.module): no weight decay on biases and norms."""
    n, res = launched
    _close(res[0]["zero"][(3, "module-param-groups")]["state"], reference(groups=True)["state"],
           "ZeRO-3 module param groups")


def test_fsdp2_beside(launched, ref):
    n, res = launched
    _close(res[0]["fsdp2"][None]["state"], ref["state"], "FSDP2 frozen + weight decay")


# ------------------------------------------------------------------------------------------------------
# hand FSDP: gradients on the module's parameters, clipping, mixed precision
# ------------------------------------------------------------------------------------------------------
def test_fsdp_module_grads_are_local_shards_of_the_reference_grad(launched, ref):
    """After the sync each trainable module parameter's .grad is a 1-D view of this rank's part of the shard
    gradient (the parameter the same part of the shard), equal to that part of the reference gradient;
    full_grads() is the whole reference gradient."""
    n, res = launched
    _close(res[0]["fsdp_grads"]["full"], ref["grads"], "full_grads")
    for rank, r in enumerate(res):
        covered = {}
        for q, info in r["fsdp_grads"]["local"].items():
            a, b = info["range"]
            assert info["grad"] is not None and info["is_view"], (rank, q)
            assert info["shape"] == (b - a,) and info["grad"].shape == (b - a,)
            torch.testing.assert_close(info["grad"], ref["grads"][q].reshape(-1)[a:b], **FP32)
            covered[q] = covered.get(q, 0) + (b - a)
        assert set(covered) == set(ref["grads"])
    total = {q: sum(r["fsdp_grads"]["local"][q]["range"][1] - r["fsdp_grads"]["local"][q]["range"][0] for r in res)
             for q in ref["grads"]}
    assert total == {q: g.numel() for q, g in ref["grads"].items()}  # the shards tile every gradient


def test_fsdp_clip_grad_norm_equals_torch(launched):
    """clip_grad_norm_(0.5) every step: the norms and the final weights equal torch.nn.utils.clip_grad_norm_
    on the reference; FSDP2 with torch's clip_grad_norm_ on DTensors beside."""
    n, res = launched
    want = reference(clip=0.5)
    for who, got in (("hand", res[0]["fsdp_grads"]["clip"]), ("fsdp2", res[0]["fsdp2"][0.5])):
        assert got["norms"] == pytest.approx(want["norms"], rel=1e-5), who
        assert max(want["norms"]) > 0.5  # the clipping really clips
        _close(got["state"], want["state"], f"{who} clipped")
    assert all(r["fsdp_grads"]["clip"]["norms"] == res[0]["fsdp_grads"]["clip"]["norms"] for r in res)
    inf = max(float(g.abs().max()) for g in reference()["grads"].values())  # norm_type=inf: the largest |g|
    assert all(r["fsdp_grads"]["inf_norm"] == pytest.approx(inf, rel=1e-5) for r in res)


@pytest.mark.parametrize("policy", list(MP_TOL), ids=["-".join(p) for p in MP_TOL])
def test_mixed_precision_beside_fsdp2(launched, policy):
    """MixedPrecisionPolicy(param_dtype, reduce_dtype): the hand-written ZeRO-3 keeps fp32 master shards and
    computes in param_dtype; its weights after 10 steps equal FSDP2's with the same policy and the one-process
    mixed-precision reference within MP_TOL[policy]; both differ from the fp32 run (the policy took effect)."""
    n, res = launched
    got = res[0]["mp"][policy]
    assert got["dtypes"] == {"shard": "torch.float32", "flat": f"torch.{policy[0]}"}
    tol = MP_TOL[policy]
    want = reference(mp=policy)
    _close(got["hand"], got["fsdp2"], f"hand vs FSDP2 {policy}", tol)
    _close(got["hand"], want["state"], f"hand vs reference {policy}", tol)
    _close(got["fsdp2"], want["state"], f"FSDP2 vs reference {policy}", tol)
    fp32 = reference()["state"]
    assert max(float((got["hand"][k] - fp32[k]).abs().max()) for k in fp32) > 1e-6


# ------------------------------------------------------------------------------------------------------
# ShardedOptimizer
# ------------------------------------------------------------------------------------------------------
def test_sharded_optimizer_parity_on_every_ddp(launched):
    """ShardedOptimizer(param groups, torch.optim.AdamW, weight_decay=0.1) on the lab's naive and bucketed DDP and
    torch DDP, 10 steps: equal to unsharded AdamW with the same groups; every parameter owned by one rank."""
    n, res = launched
    want = reference(groups=True)["state"]
    for name in ("naive", "bucket", "ddp"):
        states = [r["sharded"][name]["state"] for r in res]
        for s in states[1:]:
            assert all(torch.equal(s[k], states[0][k]) for k in s), name
        _close(states[0], want, f"ShardedOptimizer on {name}")
        owned = [q for r in res for q in r["sharded"][name]["owned"]]
        assert sorted(owned) == sorted(q for q, p in make_net().named_parameters() if p.requires_grad)
        assert all(r["sharded"][name]["owned"] for r in res)  # every rank owns something


def test_sharded_optimizer_partition_equals_torch_zero(launched, ref):
    n, res = launched
    part = res[0]["sharded"]["partition"]
    assert [sorted(x) for x in part["lab"]] == [sorted(x) for x in part["torch"]]
    _close(res[0]["sharded"]["zero_redundancy"]["state"], ref["state"], "ZeroRedundancyOptimizer")


def test_sharded_optimizer_follows_the_scheduler(launched):
    n, res = launched
    for r in res:
        assert r["sharded"]["lr"]["full"] == pytest.approx(LR / 2)
        assert r["sharded"]["lr"]["local"] == pytest.approx(LR / 2)  # copied to the local optimizer at step()


def test_sharded_optimizer_state_bytes_equal_the_calculator(launched):
    """Measured AdamW state per rank (labkit.runtime.measure) = labkit.theory.zero.sharded_optimizer_bytes, to the
    byte; summed over ranks = the unsharded optimizer state of labkit.theory.memory (convention torch-fp32); each
    rank within one parameter of the calculator's ZeRO-1 share (ParallelConfig(dp=n, zero=1))."""
    from labkit.theory import memory as mem
    from labkit.theory import zero as zt
    from labkit.theory.spec import get_spec

    n, res = launched
    spec = get_spec("lab-tiny-llama")
    train = mem.TrainConfig(convention="torch-fp32", seq_len=16)
    full = mem.train_memory(spec, mem.ParallelConfig(dp=1), train, headroom=0.0, workspace_bytes=0)
    zero1 = mem.train_memory(spec, mem.ParallelConfig(dp=n, zero=1), train, headroom=0.0, workspace_bytes=0)
    biggest = max(t.numel for t in mem.param_tensors(spec))
    total = 0
    for rank, r in enumerate(res):
        want = zt.sharded_optimizer_bytes(spec, n, rank)
        assert r["sharded"]["bytes"]["optimizer"] == want["optimizer"], rank
        assert r["sharded"]["bytes"]["n_state"] == want["owned_params"], rank
        assert abs(want["optimizer"] - zero1.categories["optimizer"]) <= 8 * biggest + 4 * len(mem.param_tensors(spec))
        total += r["sharded"]["bytes"]["optimizer"]
    assert total == full.categories["optimizer"]


# ------------------------------------------------------------------------------------------------------
# DDP wrappers
# ------------------------------------------------------------------------------------------------------
def test_bucket_cap_mb_and_one_bucket(launched):
    n, res = launched
    d = res[0]["ddp"]
    assert d["buckets"]["None"] == 1 and d["buckets"]["25.0"] == 1  # the whole model is far below 25 MiB
    assert d["buckets"][str(400 / 2**20)] > 2  # 400-byte buckets: several
    assert d["module_kept"]
    # one bucket: the lab's bucketed wrapper and torch DDP each issue exactly one all-reduce of every gradient
    numel = d["trainable_bytes"] // 4
    assert d["one_bucket_calls"] == [numel, numel]


def test_forward_through_module_still_synchronises(launched, ref):
    """The lab's wrappers synchronise at the end of any backward, whichever forward built the graph: through
    ``wrapper.module`` the gradients are the same as through the wrapper (the reference's). torch DDP keeps its
    behaviour: through ``ddp.module`` nothing is synchronised, ranks differ."""
    n, res = launched
    for name in ("naive", "bucket", "bucket-one"):
        for via in ("wrapper", "module"):
            for r in res:
                _close(r["ddp"]["grads"][(name, via)], ref["grads"], f"{name} via {via}")
    _close(res[0]["ddp"]["grads"][("ddp", "wrapper")], ref["grads"], "torch DDP via wrapper")
    g0, g1 = res[0]["ddp"]["grads"][("ddp", "module")], res[1]["ddp"]["grads"][("ddp", "module")]
    assert max(float((g0[k] - g1[k]).abs().max()) for k in g0) > 1e-4


def test_ddp_options_are_keyword_only():
    """A positional bucket size used to land in ``ctx``; now every option after ``module`` is keyword-only
    (TypeError before anything runs), and bad sizes are a ValueError naming the value."""
    from labkit.parallel.data import DataParallelBucket, DataParallelNaive, bucket_cap, torch_ddp
    from labkit.parallel.zero import ZeroDataParallel

    for cls in (DataParallelNaive, DataParallelBucket, torch_ddp):
        with pytest.raises(TypeError):
            cls(make_net(), None)
    with pytest.raises(TypeError):
        ZeroDataParallel(make_net(), 3, None)
    assert bucket_cap(None) is None and bucket_cap(1.5) == int(1.5 * 2**20) and bucket_cap(bucket_cap_bytes=64) == 64
    with pytest.raises(ValueError, match="bucket_cap_mb=-1"):
        bucket_cap(-1)
    with pytest.raises(ValueError, match="not both"):
        bucket_cap(2.0, 64)
