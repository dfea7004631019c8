"""Parameter tensors of the lab's model by name and shape, the ones each pipeline / expert rank holds, and
their model-state bytes once ZeRO shards them (evenly, or in FSDP2's dim-0 chunks).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from labkit.checks import check_choice, positive_int
from labkit.theory.memory.config import ParallelConfig
from labkit.theory.memory.conventions import _N_STATES, SHARD_LAYOUTS, Convention, _ceil_div, nbytes
from labkit.theory.memory.stages import stage_layers
from labkit.theory.spec import ModelSpec


# ------------------------------------------------------------------------------------------------------
# parameter tensors (names and shapes of labkit.models.Transformer)
# ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor: ``name`` (as in ``labkit.models.Transformer.named_parameters()`` for dense
    models), ``shape`` (nn.Linear weights are [out, in]), ``layer`` (None outside the layers), ``part``
    (``embed``, ``layer``, ``final_norm``, ``head``), ``tp_dim`` (the dimension tensor parallelism splits:
    0 for column-parallel / vocab-parallel, 1 for row-parallel, None if replicated), ``expert`` (index, or
    None for dense tensors), ``tp_max`` (the most pieces tp may cut it into: n_kv_heads for wk/wv, whose
    heads are replicated beyond that, :func:`kv_heads_per_rank`; None: no limit)."""

    name: str
    shape: tuple[int, ...]
    layer: int | None
    part: str
    tp_dim: int | None = None
    expert: int | None = None
    tp_max: int | None = None

    @property
    def numel(self) -> int:
        """Elements of the whole (unsplit) tensor."""
        return math.prod(self.shape)

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """The shape on one tensor-parallel rank: ``shape[tp_dim]`` / min(tp, tp_max)."""
        if self.tp_dim is None or tp == 1:
            return self.shape
        s = list(self.shape)
        s[self.tp_dim] //= min(tp, self.tp_max) if self.tp_max else tp
        return tuple(s)


def _linear(name, out_f, in_f, bias, layer, tp_dim, expert=None, tp_max=None) -> list[ParamTensor]:
    out = [ParamTensor(f"{name}.weight", (out_f, in_f), layer, "layer", tp_dim, expert, tp_max)]
    if bias:  # column-parallel biases split with their outputs; row-parallel biases are replicated
        out.append(ParamTensor(f"{name}.bias", (out_f,), layer, "layer", 0 if tp_dim == 0 else None, expert,
                               tp_max if tp_dim == 0 else None))
    return out


def _norm(name, spec, layer, part) -> list[ParamTensor]:
    out = [ParamTensor(f"{name}.weight", (spec.hidden_size,), layer, part)]
    if spec.norm == "layernorm":
        out.append(ParamTensor(f"{name}.bias", (spec.hidden_size,), layer, part))
    return out


def _mlp(prefix, spec, ffn, layer, expert=None) -> list[ParamTensor]:
    h, b = spec.hidden_size, spec.bias
    if spec.mlp == "swiglu":
        return (_linear(f"{prefix}.w_gate", ffn, h, b, layer, 0, expert)
                + _linear(f"{prefix}.w_up", ffn, h, b, layer, 0, expert)
                + _linear(f"{prefix}.w_down", h, ffn, b, layer, 1, expert))
    return (_linear(f"{prefix}.fc_in", ffn, h, b, layer, 0, expert)
            + _linear(f"{prefix}.fc_out", h, ffn, b, layer, 1, expert))


@functools.lru_cache(maxsize=64)
def param_tensors(spec: ModelSpec) -> tuple[ParamTensor, ...]:
    """Every parameter tensor of ``spec`` with the names and shapes ``labkit.models.build_model(spec)`` gives
    them (MoE layers: ``layers.i.mlp.router.weight`` and ``layers.i.mlp.experts.e.*``). Their numels sum to
    ``spec.n_params()`` (tests/test_memory.py)."""
    h = spec.hidden_size
    out = [ParamTensor("embed.weight", (spec.vocab_size, h), None, "embed", 0)]
    if spec.position == "learned":
        out.append(ParamTensor("pos_embed.weight", (spec.max_seq_len, h), None, "embed"))
    for i in range(spec.n_layers):
        p = f"layers.{i}"
        out += _norm(f"{p}.attn_norm", spec, i, "layer")
        out += _linear(f"{p}.attn.wq", spec.q_size, h, spec.bias, i, 0)
        out += _linear(f"{p}.attn.wk", spec.kv_size, h, spec.bias, i, 0, tp_max=spec.n_kv_heads)
        out += _linear(f"{p}.attn.wv", spec.kv_size, h, spec.bias, i, 0, tp_max=spec.n_kv_heads)
        out += _linear(f"{p}.attn.wo", h, spec.q_size, spec.bias, i, 1)
        out += _norm(f"{p}.mlp_norm", spec, i, "layer")
        if spec.is_moe_layer(i):
            out.append(ParamTensor(f"{p}.mlp.router.weight", (spec.n_experts, h), i, "layer"))
            for e in range(spec.n_experts):
                out += _mlp(f"{p}.mlp.experts.{e}", spec, spec.expert_ffn_hidden_size, i, e)
        else:
            out += _mlp(f"{p}.mlp", spec, spec.ffn_hidden_size, i)
    out += _norm("norm", spec, None, "final_norm")
    if not spec.tied_embeddings:
        out.append(ParamTensor("lm_head.weight", (spec.vocab_size, h), None, "head", 0))
    return tuple(out)


def local_param_tensors(spec: ModelSpec, parallel: ParallelConfig, stage: int = 0,
                        ep_rank: int = 0) -> list[ParamTensor]:
    """The tensors pipeline rank ``stage`` holds (before tensor-parallel splitting, see
    :meth:`ParamTensor.local_shape`): its layers, the embedding on the first stage, the final norm and head on
    the last (with tied embeddings and pp > 1 the last stage holds its own copy of the embedding, as in
    Megatron-LM), and of each MoE layer the n_experts/ep experts of expert-parallel rank ``ep_rank``. The
    stage's layers follow ``parallel.layers_per_stage`` (or the derived split, :meth:`ParallelConfig.split`)."""
    return list(_stage_tensors(spec, parallel.pp, parallel.vpp, parallel.ep, stage, ep_rank,
                               parallel.split(spec.n_layers)))


@functools.lru_cache(maxsize=1024)
def _stage_tensors(spec: ModelSpec, pp: int, vpp: int, ep: int, stage: int, ep_rank: int,
                   split: tuple[int, ...] | None = None) -> tuple[ParamTensor, ...]:
    """:func:`local_param_tensors`, cached on what it depends on (the planner asks for the same stages of
    many meshes); ``split`` the layers per stage (None: derived)."""
    layers = set(stage_layers(spec.n_layers, pp, vpp, stage, split))
    first, last = stage == 0, stage == pp - 1
    per_ep = spec.n_experts // ep if spec.is_moe else 0
    out = []
    for t in param_tensors(spec):
        if t.part == "embed":
            keep = first or (last and spec.tied_embeddings and t.name == "embed.weight")
        elif t.part in ("final_norm", "head"):
            keep = last
        else:
            keep = t.layer in layers and (t.expert is None or t.expert // per_ep == ep_rank)
        if keep:
            out.append(t)
    return tuple(out)


# ------------------------------------------------------------------------------------------------------
# ZeRO sharding: the model-state bytes of the tensors a rank holds
# ------------------------------------------------------------------------------------------------------
def shard_numel(shape: tuple[int, ...], group: int, layout: str = "even", rank: int = 0) -> int:
    """Elements of one tensor of ``shape`` that shard ``rank`` of a ZeRO group of ``group`` ranks holds.

    * ``even``: ceil(numel/group) on every rank — the ZeRO paper's Ψ/N_d (Rajbhandari et al. 2020, Fig. 1),
      rounded up per tensor; an upper bound for any even split.
    * ``dim0``: what FSDP2 ``fully_shard`` does (per-parameter sharding on dim 0, ``torch.chunk`` semantics):
      chunks of c = ceil(d0/group) rows; rank r holds max(0, min(c, d0 - r·c)) rows × the other dims, so
      rank 0 holds the most and the last ranks may hold fewer rows (or none) when group does not divide d0.

    Raises ValueError for an unknown layout, group < 1 or rank outside 0..group-1.
    """
    check_choice("shard_layout", layout, SHARD_LAYOUTS)
    group = positive_int("group", group)
    if not (isinstance(rank, int) and 0 <= rank < group):
        raise ValueError(f"rank={rank!r} must be a shard index in 0..{group - 1}")
    shape = tuple(int(d) for d in shape)
    n = math.prod(shape)
    if group == 1:
        return n
    if layout == "even" or not shape:
        return _ceil_div(n, group)
    c = _ceil_div(shape[0], group)
    rows = max(0, min(c, shape[0] - rank * c))
    return rows * math.prod(shape[1:])


def _shard(shape: tuple[int, ...], group: int, sharded: bool, layout: str, rank: int) -> int:
    if not sharded or group == 1:
        return math.prod(shape)
    return shard_numel(shape, group, layout, rank % group)


def _model_states(tensors: Iterable[tuple[ParamTensor | None, tuple[int, ...]]], conv: Convention, optimizer: str,
                  zero: int, dense_group: int, expert_group: int, layout: str = "even",
                  dp_rank: int = 0) -> dict[str, int]:
    """Bytes of parameters, gradients, optimizer state for (tensor, local shape) pairs under ZeRO ``zero``,
    on ZeRO shard ``dp_rank`` with :func:`shard_numel`'s ``layout``. Tensors of the same local shape and group
    (dense / expert) cost the same bytes, so each kind is computed once and multiplied by its count
    (:func:`_kinds`, :func:`_kind_states`)."""
    return dict(_kind_states(_kinds(tensors), conv, optimizer, zero, dense_group, expert_group, layout, dp_rank))


def _kinds(tensors) -> tuple[tuple[tuple[tuple[int, ...], bool], int], ...]:
    """((local shape, is_expert), count) for (tensor, local shape) pairs."""
    kinds: dict[tuple[tuple[int, ...], bool], int] = {}
    for t, shape in tensors:
        key = (tuple(shape), t is not None and t.expert is not None)
        kinds[key] = kinds.get(key, 0) + 1
    return tuple(kinds.items())


@functools.lru_cache(maxsize=4096)
def _kind_states(kinds, conv: Convention, optimizer: str, zero: int, dense_group: int, expert_group: int,
                 layout: str = "even", dp_rank: int = 0) -> tuple[tuple[str, int], ...]:
    """:func:`_model_states` of grouped tensors, as ((category, bytes), ...) (cached: the middle pipeline
    stages of a model hold the same kinds)."""
    out = {"parameters": 0, "gradients": 0, "optimizer": 0}
    for (shape, is_expert), count in kinds:
        g = expert_group if is_expert else dense_group

        def part(level, g=g, shape=shape):  # elements held once ZeRO stage >= level shards this state
            return _shard(shape, g, zero >= level, layout, dp_rank)

        grads16 = 0 if (zero >= 3 and conv.no_grads_at_zero3) else nbytes(part(conv.grad_shard_stage), conv.grad_bits)
        grads = grads16 + nbytes(part(1), conv.grad_fp32_bits)
        opt = nbytes(part(1), conv.master_bits)
        if optimizer == "adafactor":  # factored second moment (Shazeer & Stern 2018): rows + cols per matrix
            states = shape[0] + shape[1] if len(shape) == 2 else math.prod(shape)  # split evenly (any layout)
            opt += nbytes(_shard((states,), g, zero >= 1, "even", 0), conv.state_bits) + conv.step_bytes
        else:
            opt += _N_STATES[optimizer] * nbytes(part(1), conv.state_bits)
            opt += conv.step_bytes if optimizer == "adamw" else 0
        out["parameters"] += count * nbytes(part(3), conv.param_bits)
        out["gradients"] += count * grads
        out["optimizer"] += count * opt
    return tuple(out.items())



@functools.lru_cache(maxsize=4096)
def _stage_shapes(spec: ModelSpec, pp: int, vpp: int, ep: int, stage: int, tp: int, split=None):
    """For pipeline rank ``stage`` (expert rank 0): its tensors grouped by :func:`_kinds`, their total numel,
    and the numel of its biggest layer (cached: the planner asks for the same stages of many meshes)."""
    pairs = tuple((x, x.local_shape(tp)) for x in _stage_tensors(spec, pp, vpp, ep, stage, 0, split))
    layer_local: dict[int, int] = {}
    for x, shp in pairs:
        if x.layer is not None:
            layer_local[x.layer] = layer_local.get(x.layer, 0) + math.prod(shp)
    return _kinds(pairs), sum(math.prod(s) for _, s in pairs), max(layer_local.values(), default=0)
