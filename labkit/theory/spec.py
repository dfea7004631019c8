"""ModelSpec: the shape of a decoder-only transformer, shared by the predict side (memory, planner) and the
run side (labkit.models builds a torch module from the same spec). Pure Python, no torch.

Presets live in ``data/models.yaml``, each with the public source of its configuration. :func:`flops_per_token`
(PaLM Appendix B) lives here so the predict modules (planner) can use it without importing torch;
``labkit.models`` re-exports it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from pathlib import Path

from labkit.checks import check_choice, positive_int
from labkit.paths import data_dir
from labkit.yamlload import load_path

MLP_KINDS = ("swiglu", "gelu")
NORM_KINDS = ("rmsnorm", "layernorm")
POSITION_KINDS = ("rope", "learned")


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only transformer.

    Llama-style models: ``mlp="swiglu", norm="rmsnorm", position="rope", bias=False``.
    GPT-style models: ``mlp="gelu", norm="layernorm", position="learned", bias=True``.
    MoE: ``n_experts > 0`` experts of ``expert_ffn_hidden_size`` each, ``top_k`` active per token, in
    every ``moe_layer_freq``-th layer (1 = every layer); the other layers are dense.

    Raises ValueError (from :meth:`validate`, run at construction) for non-positive sizes, an unknown kind,
    ``n_kv_heads`` not dividing ``n_heads``, or ``top_k`` outside ``1..n_experts``.
    """

    n_layers: int
    hidden_size: int
    n_heads: int
    ffn_hidden_size: int
    vocab_size: int
    n_kv_heads: int | None = None  # None -> n_heads (multi-head attention)
    head_dim: int | None = None  # None -> hidden_size // n_heads
    mlp: str = "swiglu"
    norm: str = "rmsnorm"
    position: str = "rope"
    bias: bool = False
    tied_embeddings: bool = False
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dropout: float = 0.0
    n_experts: int = 0
    top_k: int = 0
    expert_ffn_hidden_size: int | None = None  # None -> ffn_hidden_size
    moe_layer_freq: int = 1
    name: str = "custom"
    source: str = ""
    published_params: float | None = None  # the size the source states, for checking n_params()
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.head_dim is None and self.n_heads and self.hidden_size:
            object.__setattr__(self, "head_dim", self.hidden_size // self.n_heads)
        if self.expert_ffn_hidden_size is None:
            object.__setattr__(self, "expert_ffn_hidden_size", self.ffn_hidden_size)
        self.validate()

    def validate(self) -> None:
        for name in ("n_layers", "hidden_size", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden_size",
                     "vocab_size", "max_seq_len", "moe_layer_freq"):
            positive_int(f"{self.name}.{name}", getattr(self, name))
        check_choice("mlp", self.mlp, MLP_KINDS)
        check_choice("norm", self.norm, NORM_KINDS)
        check_choice("position", self.position, POSITION_KINDS)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads} "
                             "(grouped-query attention needs whole groups)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r} must be in [0, 1)")
        if self.n_experts < 0:
            raise ValueError(f"n_experts={self.n_experts} must be >= 0 (0 = dense)")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..n_experts={self.n_experts}")

    # -- derived sizes ---------------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Layer ``layer`` (0-based) is MoE when it is the last of each group of ``moe_layer_freq``."""
        return self.is_moe and (layer + 1) % self.moe_layer_freq == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def attention_params(self) -> int:
        """Q, K, V, O projections (+ biases when ``bias``)."""
        h = self.hidden_size
        n = h * self.q_size + 2 * h * self.kv_size + self.q_size * h
        if self.bias:
            n += self.q_size + 2 * self.kv_size + h
        return n

    def mlp_params(self, ffn: int | None = None) -> int:
        """One MLP: SwiGLU has three h x ffn matrices (gate, up, down), GELU two (+ biases when ``bias``)."""
        h, f = self.hidden_size, self.ffn_hidden_size if ffn is None else ffn
        n = (3 if self.mlp == "swiglu" else 2) * h * f
        if self.bias:
            n += (2 * f if self.mlp == "swiglu" else f) + h
        return n

    def norm_params(self) -> int:
        """One norm: RMSNorm has a weight, LayerNorm a weight and a bias."""
        return self.hidden_size * (1 if self.norm == "rmsnorm" else 2)

    def layer_params(self, layer: int = 0) -> int:
        """Parameters of transformer layer ``layer`` (attention, MLP or MoE, two norms)."""
        n = self.attention_params() + 2 * self.norm_params()
        if self.is_moe_layer(layer):
            n += self.hidden_size * self.n_experts  # router
            n += self.n_experts * self.mlp_params(self.expert_ffn_hidden_size)
        else:
            n += self.mlp_params()
        return n

    def embedding_params(self) -> int:
        """Token embedding (+ learned positions); the output head when not tied is counted separately."""
        n = self.vocab_size * self.hidden_size
        if self.position == "learned":
            n += self.max_seq_len * self.hidden_size
        return n

    def head_params(self) -> int:
        """Output projection to the vocabulary (0 when tied to the embedding)."""
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden_size

    def n_params(self) -> int:
        """Total parameters: embeddings + every layer + final norm + output head. Counted from the shapes
        above; the presets' totals match their sources' stated sizes within 0.5 % (tests/test_spec.py)."""
        return (self.embedding_params() + sum(self.layer_params(i) for i in range(self.n_layers))
                + self.norm_params() + self.head_params())

    def n_active_params(self) -> int:
        """Parameters a token passes through: for MoE layers only ``top_k`` of the experts count."""
        if not self.is_moe:
            return self.n_params()
        inactive = (self.n_experts - self.top_k) * self.mlp_params(self.expert_ffn_hidden_size)
        return self.n_params() - self.n_moe_layers * inactive

    def check_seq_len(self, seq_len, name: str = "seq_len") -> int:
        """Return ``seq_len`` as int if ``1 <= seq_len <= max_seq_len``; else ValueError naming the value, this
        model and the valid range (the one check every caller of the model uses)."""
        from labkit.checks import positive_int

        n = positive_int(name, seq_len)
        if n > self.max_seq_len:
            raise ValueError(f"{name}={n} exceeds model {self.name!r}'s max_seq_len={self.max_seq_len}; "
                             f"use {name} <= {self.max_seq_len}")
        return n

    def replace(self, **changes) -> ModelSpec:
        """A copy with some fields changed (validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("extra", None)
        return d


@functools.lru_cache(maxsize=4)
def _load_yaml(path: str) -> dict:
    return load_path(path) or {}  # PyYAML (libyaml when built), else labkit.yamlload's reader


def presets(path: str | Path | None = None) -> dict[str, ModelSpec]:
    """All presets in ``data/models.yaml`` (or ``path``) by name."""
    raw = _load_yaml(str(path or data_dir() / "models.yaml"))
    fields = {f.name for f in dataclasses.fields(ModelSpec)}
    out = {}
    for name, cfg in raw.get("models", {}).items():
        known = {k: v for k, v in cfg.items() if k in fields}
        extra = {k: v for k, v in cfg.items() if k not in fields}
        out[name] = ModelSpec(name=name, extra=extra, **known)
    return out


def get_spec(name: str, **overrides) -> ModelSpec:
    """The preset ``name`` from data/models.yaml, with optional field overrides.

    Raises ValueError for an unknown name, listing the valid ones.
    """
    table = presets()
    if name not in table:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(sorted(table))}")
    spec = table[name]
    return spec.replace(**overrides) if overrides else spec


def flops_per_token_terms(spec: ModelSpec, seq_len: int, training: bool = True) -> dict[str, float]:
    """The two terms of :func:`flops_per_token`: ``dense`` = ``6·N`` (training; ``2·N`` forward alone), the
    matmuls with the weights, and ``attention`` = ``12·L·n_heads·head_dim·T`` (``4·...`` forward alone), the
    score and value matmuls over the full T x T matrix. Source and conventions: :func:`flops_per_token`."""
    seq_len = positive_int("seq_len", seq_len)
    n = spec.n_active_params() - spec.embedding_params()
    if spec.tied_embeddings:
        n += spec.vocab_size * spec.hidden_size  # the head matmul still happens with tied weights
    third = 1 if training else 3
    return {"dense": float(6 * n / third),
            "attention": float(12 * spec.n_layers * spec.n_heads * spec.head_dim * seq_len / third)}


def flops_per_token(spec: ModelSpec, seq_len: int, training: bool = True) -> float:
    """Model FLOPs per token: ``6·N + 12·L·n_heads·head_dim·T`` for training (forward + backward),
    a third of that for a forward pass alone (the two terms: :func:`flops_per_token_terms`).

    Source: PaLM (Chowdhery et al. 2022), Appendix B (MFU): N is the parameter count excluding the input
    embedding lookup (the output head is a matmul and counts), the second term the attention score and
    value matmuls over the full T x T matrix (causal masking not subtracted, as in PaLM). MoE: N counts only
    the top_k active experts. N also holds the norm (and bias) parameters, which are not matmuls: a FLOP
    counter that counts matmuls finds that much less (tests/test_scaling.py counts the lab's step).
    """
    terms = flops_per_token_terms(spec, seq_len, training)
    return float(terms["dense"] + terms["attention"])
