"""The lab's model and training harness, used by every strategy chapter.

* :class:`Transformer` — a small decoder-only transformer built from a :class:`~labkit.theory.spec.ModelSpec`:
  Llama-style (RMSNorm, RoPE, grouped-query attention, SwiGLU) or GPT-style (LayerNorm, learned positions,
  GELU(tanh), biases, dropout). Attention is ``F.scaled_dot_product_attention`` ("sdpa", the default) or an
  eager kernel that materialises the score matrix ("eager").
* :class:`SyntheticLM` — a deterministic, learnable token stream (no downloads): a sparse random Markov
  chain, so the loss falls from ln(vocab) toward the chain's entropy.
* :func:`train_reference` — the single-process reference loop over the global batch that every parallel
  variant is compared with (same full weights, same batches, AdamW).
* :func:`flops_per_token`, :func:`measure_matmul_peak`, :func:`mfu` — throughput and model FLOPs
  utilisation against the machine's measured matmul peak.

Parallel variants rebuild or re-shard these modules; they rely on the attribute names documented on each
class, and on attention inferring its local head counts from tensor shapes (so TP can shrink wq/wk/wv).
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.checks import check_choice, positive_float, positive_int
from labkit.mlp import GeluMLP, SwiGLU
from labkit.parallel.expert import MoE
from labkit.theory.spec import ModelSpec, flops_per_token, get_spec

ATTENTION_KINDS = ("sdpa", "eager")

#: Parity tolerances per dtype, used by every test that compares a parallel run with the reference.
#: fp32: different reduction orders (all-reduce vs one big matmul) differ by ~1e-6 relative per op;
#: after several AdamW steps 1e-4 / 1e-5 holds with margin. bf16: 8 bits of mantissa.
TOLERANCES = {
    torch.float32: {"rtol": 1e-4, "atol": 1e-5},
    torch.float64: {"rtol": 1e-7, "atol": 1e-9},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
    torch.float16: {"rtol": 5e-3, "atol": 5e-3},
}


# ------------------------------------------------------------------------------------------------------
# building blocks
# ------------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight``. Shape [..., H] -> [..., H]."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)  # [..., H] -> [..., H]


def make_norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return RMSNorm(spec.hidden_size, spec.norm_eps)
    return nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [max_seq_len, head_dim/2] for rotary embeddings (Su et al. 2021, eq. 34)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # [d/2]
    ang = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv)  # [T_max, d/2]: position x frequency
    return ang.cos().float(), ang.sin().float()  # [T_max, d/2] each


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x [B, heads, T, d] by the angles in cos/sin [T, d/2]."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]  # [B, heads, T, d/2] each
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # [T, d/2], broadcast over B and heads
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)  # [B, heads, T, d]


def eager_attention(q, k, v, *, causal: bool = True, dropout_p: float = 0.0, training: bool = False):
    """softmax(q k^T / sqrt(d) + mask) v with the [B, heads, Tq, Tk] score matrix materialised.
    q [B, h, Tq, d], k/v [B, h, Tk, d] -> [B, h, Tq, d]. The causal mask aligns the last query with the
    last key (Tq <= Tk)."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # [B, h, Tq, Tk]
    if causal:
        tq, tk = q.shape[-2], k.shape[-2]
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(diagonal=tk - tq)  # [Tq, Tk]
        scores = scores.masked_fill(~mask, float("-inf"))  # [B, h, Tq, Tk]
    probs = torch.softmax(scores, dim=-1)  # [B, h, Tq, Tk], each row sums to 1
    if dropout_p and training:
        probs = F.dropout(probs, dropout_p)
    return probs @ v  # [B, h, Tq, d]


def sdpa_attention(q, k, v, *, causal: bool = True, dropout_p: float = 0.0, training: bool = False):
    """``F.scaled_dot_product_attention`` (flash / memory-efficient kernels where available)."""
    # q [B, h, Tq, d], k/v [B, h, Tk, d] -> [B, h, Tq, d]
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p if training else 0.0)


class Attention(nn.Module):
    """Multi-head / grouped-query self-attention.

    Attributes: ``wq`` [H -> n_heads*d], ``wk``, ``wv`` [H -> n_kv_heads*d], ``wo`` [n_heads*d -> H]
    (nn.Linear), ``head_dim``, ``core`` (the attention kernel: a callable (q, k, v, causal=, dropout_p=,
    training=) -> out; context parallelism swaps it), ``rope_cos``/``rope_sin`` buffers when RoPE is used.

    The local numbers of query and key/value heads are read from the projections' output widths, so a
    tensor-parallel rank holding n_heads/tp heads runs the same code. Input [B, T, H] -> output [B, T, H].
    """

    def __init__(self, spec: ModelSpec, attention: str = "sdpa"):
        super().__init__()
        check_choice("attention", attention, ATTENTION_KINDS)
        h, d = spec.hidden_size, spec.head_dim
        self.head_dim = d
        self.dropout_p = spec.dropout
        self.wq = nn.Linear(h, spec.n_heads * d, bias=spec.bias)
        self.wk = nn.Linear(h, spec.n_kv_heads * d, bias=spec.bias)
        self.wv = nn.Linear(h, spec.n_kv_heads * d, bias=spec.bias)
        self.wo = nn.Linear(spec.n_heads * d, h, bias=spec.bias)
        self.core = sdpa_attention if attention == "sdpa" else eager_attention
        self.use_rope = spec.position == "rope"
        if self.use_rope:
            cos, sin = rope_tables(d, spec.max_seq_len, spec.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape  # x [B, T, H]
        d = self.head_dim
        q = self.wq(x).view(b, t, -1, d).transpose(1, 2)  # [B, n_heads, T, d] (n_heads/tp under TP)
        k = self.wk(x).view(b, t, -1, d).transpose(1, 2)  # [B, n_kv_heads, T, d]
        v = self.wv(x).view(b, t, -1, d).transpose(1, 2)  # [B, n_kv_heads, T, d]
        if self.use_rope:
            pos = torch.arange(t, device=x.device) if positions is None else positions  # [T]
            cos, sin = self.rope_cos[pos], self.rope_sin[pos]  # [T, d/2] each
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # shapes unchanged
        n_rep = q.shape[1] // k.shape[1]
        if n_rep > 1:  # grouped-query attention: each kv head serves n_rep query heads
            k = k.repeat_interleave(n_rep, dim=1)  # [B, n_heads, T, d]
            v = v.repeat_interleave(n_rep, dim=1)  # [B, n_heads, T, d]
        out = self.core(q, k, v, causal=True, dropout_p=self.dropout_p, training=self.training)  # [B, n_heads, T, d]
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))  # [B, T, n_heads*d] -> [B, T, H]


def make_mlp(spec: ModelSpec, ffn_hidden_size: int | None = None) -> nn.Module:
    f = spec.ffn_hidden_size if ffn_hidden_size is None else ffn_hidden_size
    return SwiGLU(spec.hidden_size, f, spec.bias) if spec.mlp == "swiglu" else GeluMLP(spec.hidden_size, f, spec.bias)


class Block(nn.Module):
    """Pre-norm transformer layer: ``x + drop(attn(attn_norm(x)))``, then ``x + drop(mlp(mlp_norm(x)))``.

    Attributes: ``attn_norm``, ``attn`` (:class:`Attention`), ``mlp_norm``, ``mlp`` (:class:`SwiGLU` or
    :class:`GeluMLP`; with ``moe=True`` a :class:`labkit.parallel.expert.MoE`, whose dropped tokens pass
    through on the residual path). Runs alone (RoPE tables live in ``attn``). [B, T, H] -> [B, T, H].
    """

    def __init__(self, spec: ModelSpec, attention: str = "sdpa", moe: bool = False):
        super().__init__()
        self.attn_norm = make_norm(spec)
        self.attn = Attention(spec, attention)
        self.mlp_norm = make_norm(spec)
        if moe:
            self.mlp = MoE.from_spec(spec)
        else:
            self.mlp = make_mlp(spec)
        self.dropout_p = spec.dropout

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = x + F.dropout(self.attn(self.attn_norm(x), positions), self.dropout_p, self.training)  # [B, T, H]
        return x + F.dropout(self.mlp(self.mlp_norm(x)), self.dropout_p, self.training)  # [B, T, H]


class Transformer(nn.Module):
    """Decoder-only language model. tokens [B, T] (int64) -> logits [B, T, vocab_size] (float).

    Attributes: ``spec``, ``embed`` (nn.Embedding [V, H]), ``pos_embed`` (nn.Embedding [max_seq_len, H],
    only for learned positions, else None), ``layers`` (nn.ModuleList of :class:`Block`), ``norm``,
    ``lm_head`` (nn.Linear [H -> V], None when embeddings are tied: logits then use ``embed.weight``).
    MoE specs (``n_experts > 0``): layer i's MLP is a :class:`labkit.parallel.expert.MoE` when
    ``spec.is_moe_layer(i)`` (no capacity limit by default; see ``labkit.parallel.expert.set_capacity_factor``).

    ``positions`` (int64 [T], optional) gives each token's absolute position (default 0..T-1); context
    parallelism passes the positions of its sequence shard.
    """

    def __init__(self, spec: ModelSpec, attention: str = "sdpa"):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.pos_embed = nn.Embedding(spec.max_seq_len, spec.hidden_size) if spec.position == "learned" else None
        self.layers = nn.ModuleList(Block(spec, attention, moe=spec.is_moe_layer(i)) for i in range(spec.n_layers))
        self.norm = make_norm(spec)
        self.lm_head = None if spec.tied_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def embed_tokens(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] -> hidden [B, T, H] (token + learned position embeddings, dropout)."""
        x = self.embed(tokens)  # [B, T] -> [B, T, H]
        if self.pos_embed is not None:
            pos = torch.arange(tokens.shape[1], device=tokens.device) if positions is None else positions  # [T]
            x = x + self.pos_embed(pos)  # [B, T, H] + [T, H]
        return F.dropout(x, self.spec.dropout, self.training)  # [B, T, H]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """hidden [B, T, H] -> logits [B, T, V] (final norm, then the output projection)."""
        x = self.norm(x)  # [B, T, H]
        return self.lm_head(x) if self.lm_head is not None else x @ self.embed.weight.t()  # [B, T, V]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        self.spec.check_seq_len(tokens.shape[1], "sequence length")
        x = self.embed_tokens(tokens, positions)  # tokens [B, T] -> [B, T, H]
        for layer in self.layers:
            x = layer(x, positions)  # [B, T, H]
        return self.head(x)  # [B, T, V]


def init_weights(model: nn.Module, seed: int, n_layers: int) -> None:
    """GPT-2 initialisation (Radford et al. 2019): N(0, 0.02) for linear and embedding weights, zero
    biases, unit norm weights, output projections (``wo``, ``w_down``, ``fc_out``) scaled by 1/sqrt(2L).
    Drawn from one CPU generator in parameter order, so the weights depend only on (spec, seed)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 2)
        if name.endswith("bias"):
            init = torch.zeros(p.shape)
        elif "norm" in name:
            init = torch.ones(p.shape)
        else:
            std = 0.02 / math.sqrt(2 * n_layers) if len(leaf) > 1 and leaf[-2] in ("wo", "w_down", "fc_out") else 0.02
            init = torch.randn(p.shape, generator=g) * std
        with torch.no_grad():
            p.copy_(init.to(p.dtype))


def build_model(spec: ModelSpec | str, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", attention: str = "sdpa") -> Transformer:
    """The lab's model with deterministic weights: the same (spec, seed) gives the same weights on every
    rank, device and world size (initialised on CPU in fp32, then moved and cast).

    ``spec``: a ModelSpec or a preset name. Raises ValueError for an unknown preset or attention kind.
    """
    if isinstance(spec, str):
        spec = get_spec(spec)
    model = Transformer(spec, attention)
    init_weights(model, seed, spec.n_layers)
    return model.to(device=device, dtype=dtype)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits [B, T, V], targets [B, T] -> scalar."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))  # [B*T, V], [B*T]


# ------------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------------
class SyntheticLM:
    """A deterministic, learnable token stream: a random sparse Markov chain.

    Each token has ``branching`` possible successors with fixed random probabilities (drawn once from
    ``seed``), so a model can learn it: the loss falls from ln(vocab_size) toward the chain's entropy rate
    (at most ln(branching)). ``batch(step, batch_size)`` is a pure function of (seed, step, batch_size):
    every rank can draw the global batch and take its shard.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int = 0, branching: int = 4):
        self.vocab_size = positive_int("vocab_size", vocab_size, minimum=2)
        self.seq_len = positive_int("seq_len", seq_len)
        self.seed = int(seed)
        self.branching = positive_int("branching", min(branching, vocab_size))
        g = torch.Generator().manual_seed(self.seed)
        self.successors = torch.stack([torch.randperm(vocab_size, generator=g)[: self.branching]
                                       for _ in range(vocab_size)])
        self.probs = torch.softmax(torch.randn(vocab_size, self.branching, generator=g) * 1.5, dim=-1)

    def entropy_rate(self) -> float:
        """Entropy (nats/token) of the next token given the current one, averaged uniformly over tokens:
        the loss a perfect model approaches."""
        return float(-(self.probs * self.probs.log()).sum(-1).mean())

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets), both int64 [batch_size, seq_len]; targets are tokens shifted by one."""
        batch_size = positive_int("batch_size", batch_size)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(step))
        seq = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(self.vocab_size, (batch_size,), generator=g)
        for t in range(self.seq_len):
            cur = seq[:, t]
            choice = torch.multinomial(self.probs[cur], 1, generator=g).squeeze(1)
            seq[:, t + 1] = self.successors[cur, choice]
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def shard(x: torch.Tensor, index: int, n: int, dim: int = 0) -> torch.Tensor:
    """The ``index``-th of ``n`` equal contiguous chunks of ``x`` along ``dim``.

    Raises ValueError if n does not divide x.shape[dim] (naming the valid n) or index is out of range.
    """
    from labkit.checks import check_divides

    check_divides("n", n, f"size of dim {dim}", x.shape[dim])
    if not 0 <= index < n:
        raise ValueError(f"index={index} must be in 0..{n - 1}")
    size = x.shape[dim] // n
    return x.narrow(dim, index * size, size)


# ------------------------------------------------------------------------------------------------------
# training
# ------------------------------------------------------------------------------------------------------
def make_optimizer(params, lr: float = 1e-3, weight_decay: float = 0.0) -> torch.optim.AdamW:
    """AdamW (Loshchilov & Hutter 2019) with betas (0.9, 0.95), eps 1e-8 — the lab's one optimizer, so
    every variant's update is the same arithmetic. ``foreach=False`` keeps the per-parameter update order
    identical between a sharded and an unsharded run."""
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay,
                             foreach=False)


def train_reference(spec: ModelSpec | str, *, steps: int, global_batch_size: int, seq_len: int,
                    lr: float = 1e-3, seed: int = 0, data_seed: int = 0, n_microbatches: int = 1,
                    dtype: torch.dtype = torch.float32, attention: str = "sdpa", model: nn.Module | None = None,
                    return_grads: bool = False) -> dict:
    """The single-process reference: ``steps`` AdamW steps on the global batch.

    Gradient accumulation over ``n_microbatches`` equal micro-batches averages their losses, so the update
    equals one step on the whole batch. Returns a dict:
    ``losses`` (list of floats, one per step, mean over the global batch), ``state_dict`` (final weights,
    CPU tensors), ``grads`` (last step's gradients by parameter name, if ``return_grads``), ``tokens``
    (tokens processed), ``seconds`` (measured wall time of the steps), ``tokens_per_s``.

    Raises ValueError if n_microbatches does not divide global_batch_size.
    """
    steps = positive_int("steps", steps)
    global_batch_size = positive_int("global_batch_size", global_batch_size)
    from labkit.checks import check_divides

    check_divides("n_microbatches", n_microbatches, "global_batch_size", global_batch_size)
    if isinstance(spec, str):
        spec = get_spec(spec)
    model = model if model is not None else build_model(spec, seed, dtype=dtype, attention=attention)
    opt = make_optimizer(model.parameters(), lr)
    data = SyntheticLM(spec.vocab_size, seq_len, data_seed)
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        tokens, targets = data.batch(step, global_batch_size)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for mb in range(n_microbatches):
            tk, tg = shard(tokens, mb, n_microbatches), shard(targets, mb, n_microbatches)
            loss = lm_loss(model(tk), tg) / n_microbatches
            loss.backward()
            total += loss.item()
        opt.step()
        losses.append(total)
    seconds = time.perf_counter() - t0
    out = {"losses": losses, "state_dict": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
           "tokens": steps * global_batch_size * seq_len, "seconds": seconds,
           "tokens_per_s": steps * global_batch_size * seq_len / seconds}
    if return_grads:
        out["grads"] = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out


# ------------------------------------------------------------------------------------------------------
# throughput and MFU
# ------------------------------------------------------------------------------------------------------
def measure_matmul_peak(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, n: int = 1024,
                        repeats: int = 5) -> float:
    """Measured dense matmul throughput (FLOP/s) of an n x n x n product on ``device``: the best of
    ``repeats`` timed runs after one warm-up, 2·n^3 FLOPs each. On CPU it uses the current
    ``torch.get_num_threads()``; on CUDA it synchronises around the timed region. This is the
    denominator the lab uses for MFU on machines without a published peak (measured, not a datasheet)."""
    n = positive_int("n", n)
    device = torch.device(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    a @ b
    sync()
    best = float("inf")
    for _ in range(positive_int("repeats", repeats)):
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def mfu(tokens_per_s: float, spec: ModelSpec, seq_len: int, peak_flops: float, training: bool = True) -> float:
    """Model FLOPs utilisation = tokens/s x :func:`flops_per_token` / peak FLOP/s (PaLM, Appendix B).
    ``peak_flops`` is per the devices that produced ``tokens_per_s`` together."""
    positive_float("tokens_per_s", tokens_per_s, allow_zero=True)
    positive_float("peak_flops", peak_flops)
    return tokens_per_s * flops_per_token(spec, seq_len, training) / peak_flops
