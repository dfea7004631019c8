"""Compute priced by shape: the seconds of one GPU kernel from its shape, dtype and the device's facts.

Pure Python (no torch). One model for every caller: the planner's per-layer work
(:mod:`labkit.theory.steptime`), the emulator's traced operations (:meth:`labkit.theory.cluster.Cluster.kernel_s`)
and ``labkit calibrate`` (which fits :class:`KernelParams` for a machine by calling :func:`gemm_s` with candidate
parameters). Times in seconds, sizes in elements, bytes in bytes, FLOP/s = 1e12 x TFLOP/s.

Three kernel families:

* **GEMM** (:func:`gemm_s`): ``C[batch, m, n] = A[batch, m, k] @ B[batch, k, n]``, 2·batch·m·n·k FLOPs. The
  output is cut into tiles of ``tile_m x tile_n``, one thread block per tile, at most one block per SM at a time
  (a Hopper/Ampere GEMM's large tiles fill an SM). Two quantisations follow, as NVIDIA's "Matrix Multiplication
  Background User's Guide" (docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication,
  sections "Tile Quantization" and "Wave Quantization") describes them: a partial tile costs a whole tile, and
  the tiles run in ``ceil(tiles / sm_count)`` waves, the last one partly idle. A tile's own rate is
  ``gemm_efficiency`` of the SM's share of the peak times ``k / (k + gemm_k_half)`` (the fixed prologue and
  epilogue of a tile — loading the pipeline, writing C — amortised over K; small or skinny-K GEMMs are slower
  per FLOP). The kernel picks the fastest of :data:`GEMM_TILES` (cuBLAS's heuristics choose among tile
  shapes); a smaller tile runs at its arithmetic intensity ``tm·tn/(tm+tn)`` relative to the largest tile's
  (less reuse of each loaded element). Then a roofline against memory: A, B and C cross HBM at least once.
* **attention** (:func:`attention_s`): a fused flash-attention kernel (Dao et al. 2022/2023, FlashAttention /
  FlashAttention-2): 4·b·h·q·kv·d FLOPs forward (QKᵀ and PV), 2.5x that backward (five matmuls instead of
  two, the forward recomputed: FlashAttention-2 paper, Sec. 4 counts), half the score matrix with a causal
  mask on q == kv; blocks of ``ATTN_BLOCK_Q`` query rows per (batch, head), in waves over the SMs; the rate
  is ``attention_efficiency`` of the peak; memory traffic Q, K, V, O (and dO, dQ, dK, dV backward).
* **memory-bound** (:func:`memory_s`): norms, activations, residual adds, rotary embedding, the optimizer step,
  decode: ``max(bytes / (memory bandwidth · memory_efficiency), flops / (peak · gemm_efficiency))``.

Every kernel also costs ``launch_s`` (a launch and its tail: a kernel of no work still takes microseconds).

The parameters (:class:`KernelParams`): device facts (``sm_count``, tile shapes; not fitted) and the free
ones (:data:`FREE_PARAMS`), whose defaults per device are data/hardware.yaml's ``kernels:`` entry of the
device, each with its public source (:func:`kernel_params`). One model, no per-run factor.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, fields, replace

#: the tile shapes (tile_m, tile_n) a GEMM kernel may use, largest first (CUTLASS's and cuBLAS's common
#: threadblock tiles for Ampere/Hopper tensor cores; NVIDIA's Matrix Multiplication Background guide lists
#: 256x128, 128x128, 128x64, 64x64 as the tile sizes cuBLAS picks among)
GEMM_TILES = ((256, 128), (128, 128), (128, 64), (64, 64))
#: query rows per flash-attention thread block (FlashAttention-2's forward block, 128 for head_dim <= 128)
ATTN_BLOCK_Q = 128
#: the parameters labkit calibrate fits (the others are device facts)
FREE_PARAMS = ("gemm_efficiency", "gemm_k_half", "attention_efficiency", "memory_efficiency", "launch_s")
KINDS = ("gemm", "attention", "memory", "other")


@dataclass(frozen=True)
class KernelParams:
    """The kernel model's parameters for one device.

    Attributes:
        gemm_efficiency: fraction of the dense peak a large, well-shaped GEMM sustains, in (0, 1].
        gemm_k_half: K (elements) at which a tile runs at half of ``gemm_efficiency`` (prologue / epilogue
            amortisation), >= 0.
        attention_efficiency: fraction of the dense peak a flash-attention kernel sustains (forward and
            backward together), in (0, 1].
        memory_efficiency: fraction of the memory bandwidth a streaming kernel reaches, in (0, 1].
        launch_s: seconds every kernel costs besides its work (>= 0).
        sm_count: streaming multiprocessors (a CPU: cores), the width of one wave (device fact, >= 1).
        tiles: the GEMM tile shapes, largest first (device fact).
        source: where the values come from (a URL per value, or "fit (...)").

    Raises ValueError for a value out of range (naming it).
    """

    gemm_efficiency: float = 0.8
    gemm_k_half: float = 64.0
    attention_efficiency: float = 0.5
    memory_efficiency: float = 0.8
    launch_s: float = 3e-6
    sm_count: int = 1
    tiles: tuple = GEMM_TILES
    source: str = ""

    def __post_init__(self):
        for name in ("gemm_efficiency", "attention_efficiency", "memory_efficiency"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"{name}={v!r} must be a number in (0, 1] (a fraction of the peak)")
        for name in ("gemm_k_half", "launch_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0 or math.isinf(v):
                raise ValueError(f"{name}={v!r} must be a finite number >= 0")
        if isinstance(self.sm_count, bool) or not isinstance(self.sm_count, int) or self.sm_count < 1:
            raise ValueError(f"sm_count={self.sm_count!r} must be an integer >= 1")
        tiles = tuple(tuple(int(x) for x in t) for t in self.tiles)
        if not tiles or any(len(t) != 2 or min(t) < 1 for t in tiles):
            raise ValueError(f"tiles={self.tiles!r} must be a non-empty list of (tile_m, tile_n) pairs >= 1")
        object.__setattr__(self, "tiles", tiles)

    def to_dict(self) -> dict:
        """Plain data (JSON-able); :meth:`from_dict` reads it back."""
        d = asdict(self)
        d["tiles"] = [list(t) for t in self.tiles]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> KernelParams:
        """The params :meth:`to_dict` wrote (unknown keys: ValueError naming them)."""
        known = {f.name for f in fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise ValueError(f"unknown KernelParams keys {bad}; known: {sorted(known)}")
        return cls(**{k: (tuple(tuple(t) for t in v) if k == "tiles" else v) for k, v in d.items()})

    def replace(self, **changes) -> KernelParams:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


@functools.lru_cache(maxsize=64)
def kernel_params(device: str) -> KernelParams:
    """The defaults for ``device`` (a ``devices:`` name of data/hardware.yaml): its ``sm_count`` and its
    ``kernels:`` entry (each free parameter with its source). ``gemm_efficiency`` there is a measured GEMM's
    achieved fraction of peak at ``gemm_efficiency_shape`` (m, n, k): the tile rate is scaled so that
    :func:`gemm_efficiency` gives exactly that fraction at that shape (the model's own tile and wave
    quantisation taken out). A device without an entry gets the class defaults, with ``source`` saying so.
    Raises ValueError for an unknown device."""
    from labkit.theory import costmodel

    d = costmodel.get_device(device)
    k = dict(d.get("kernels") or {})
    vals = {n: float(k[n]) for n in FREE_PARAMS if n in k}
    src = "; ".join(f"{n}: {k[n + '_source']}" for n in FREE_PARAMS if n + "_source" in k)
    p = KernelParams(**vals, sm_count=int(d.get("sm_count", 1)),
                     source=src or f"{device}: no kernels entry in data/hardware.yaml (class defaults)")
    shape = k.get("gemm_efficiency_shape")
    if shape and "peak_bf16_tflops" in d:
        # gemm_efficiency is a measured best shape's achieved fraction: the tile rate is set so that the model
        # gives exactly that fraction at that shape (its own wave and tile quantisation taken out)
        peak, bw = float(d["peak_bf16_tflops"]) * 1e12, float(d.get("hbm_gbps", d.get("memory_gbps", 1e3)))
        got = gemm_efficiency(*shape, peak_flops=peak, memory_gbps=bw, params=p.replace(launch_s=0.0))
        p = p.replace(gemm_efficiency=min(1.0, p.gemm_efficiency ** 2 / got))
    return p


def _check_dims(**dims) -> None:
    for name, v in dims.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0 or math.isinf(v):
            raise ValueError(f"{name}={v!r} must be a finite number >= 0")


def gemm_s(m: float, n: float, k: float, *, batch: float = 1, peak_flops: float, memory_gbps: float,
           params: KernelParams, dtype_bytes: int = 2) -> float:
    """Seconds of one (batched) GEMM ``[batch, m, k] @ [batch, k, n]`` (module docstring for the model):

    ``t = max(min over tiles (tm, tn) of waves · 2·tm·tn·k / (peak/sm · eff · r(tm,tn) · k/(k + k_half)),
    (m·k + k·n + m·n)·batch·e / (bw · memory_efficiency)) + launch_s`` with
    ``waves = ceil(batch·ceil(m/tm)·ceil(n/tn) / sm_count)``, ``r`` = the tile's intensity over the largest
    tile's, e = ``dtype_bytes``. Sources: NVIDIA's Matrix Multiplication Background User's Guide (tile and wave
    quantisation); the efficiencies: :func:`kernel_params`.

    ``peak_flops`` in FLOP/s (dense, the GEMM's dtype; ``math.inf`` allowed), ``memory_gbps`` in GB/s.
    A zero dimension costs only the launch. Raises ValueError for a negative or non-finite dimension.
    """
    _check_dims(m=m, n=n, k=k, batch=batch)
    if not (m and n and k and batch):
        return params.launch_s
    t_mem = (m * k + k * n + m * n) * batch * dtype_bytes / (memory_gbps * 1e9 * params.memory_efficiency)
    if math.isinf(peak_flops):
        return t_mem + params.launch_s
    per_sm = peak_flops / params.sm_count * params.gemm_efficiency * k / (k + params.gemm_k_half)
    big = params.tiles[0][0] * params.tiles[0][1] / (params.tiles[0][0] + params.tiles[0][1])
    best = math.inf
    for tm, tn in params.tiles:
        rel = min(1.0, tm * tn / (tm + tn) / big)
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / params.sm_count)
        best = min(best, waves * 2.0 * tm * tn * k / (per_sm * rel))
    return max(best, t_mem) + params.launch_s


def gemm_efficiency(m, n, k, *, batch=1, peak_flops: float, memory_gbps: float, params: KernelParams,
                    dtype_bytes: int = 2) -> float:
    """Achieved fraction of ``peak_flops`` of :func:`gemm_s` for that shape (2·batch·m·n·k / (t · peak))."""
    t = gemm_s(m, n, k, batch=batch, peak_flops=peak_flops, memory_gbps=memory_gbps, params=params,
               dtype_bytes=dtype_bytes)
    return 2.0 * batch * m * n * k / (t * peak_flops)


def attention_flops(batch, heads, q_len, kv_len, head_dim, causal: bool = True, backward: bool = False) -> float:
    """FLOPs of flash attention: 4·b·h·q·kv·d forward (QKᵀ and PV), x 2.5 backward (FlashAttention-2, Dao 2023,
    Sec. 4.1: the backward's five matmuls against the forward's two); a causal mask on a square block (q ==
    kv: the diagonal chunk) skips half of it; q < kv (a query chunk against earlier keys) is unmasked."""
    f = 4.0 * batch * heads * q_len * kv_len * head_dim
    if causal and q_len == kv_len:
        f *= 0.5
    return f * (2.5 if backward else 1.0)


def attention_s(batch, heads, q_len, kv_len, head_dim, *, causal: bool = True, backward: bool = False,
                kv_heads=None, peak_flops: float, memory_gbps: float, params: KernelParams,
                dtype_bytes: int = 2) -> float:
    """Seconds of one flash-attention kernel (forward, or with ``backward`` its backward) of ``batch`` x
    ``heads`` query heads of ``q_len`` rows against ``kv_len`` keys of ``head_dim`` (``kv_heads`` None = heads).

    ``t = max(waves · block_flops / (peak/sm · attention_efficiency), bytes / (bw · memory_efficiency)) +
    launch_s`` with blocks of :data:`ATTN_BLOCK_Q` query rows per (batch, head) in
    ``waves = ceil(batch·heads·ceil(q/128) / sm_count)`` waves, block_flops = :func:`attention_flops` of one
    block, bytes = Q, O (and dO, dQ) plus K, V (and dK, dV) once. Sources: FlashAttention-2 (Dao 2023, Sec.
    3.2 parallelism over batch, heads and query blocks); efficiencies: :func:`kernel_params`.
    Raises ValueError for a negative or non-finite size."""
    _check_dims(batch=batch, heads=heads, q_len=q_len, kv_len=kv_len, head_dim=head_dim)
    if not (batch and heads and q_len and kv_len and head_dim):
        return params.launch_s
    kvh = heads if kv_heads is None else kv_heads
    mult = 2 if backward else 1
    nbytes = mult * (2 * q_len * heads + 2 * kv_len * kvh) * head_dim * batch * dtype_bytes
    t_mem = nbytes / (memory_gbps * 1e9 * params.memory_efficiency)
    if math.isinf(peak_flops):
        return t_mem + params.launch_s
    blocks_q = math.ceil(q_len / ATTN_BLOCK_Q)
    waves = math.ceil(batch * heads * blocks_q / params.sm_count)
    block = attention_flops(1, 1, q_len, kv_len, head_dim, causal, backward) / blocks_q
    t = waves * block / (peak_flops / params.sm_count * params.attention_efficiency)
    return max(t, t_mem) + params.launch_s


def memory_s(nbytes: float, flops: float = 0.0, *, peak_flops: float, memory_gbps: float,
             params: KernelParams) -> float:
    """Seconds of one memory-bound kernel (norm, activation, residual add, optimizer step, decode):
    ``max(nbytes / (memory_gbps · 1e9 · memory_efficiency), flops / (peak_flops · gemm_efficiency)) +
    launch_s`` (the roofline, Williams, Waterman & Patterson 2009, CACM 52(4)). Raises ValueError for a
    negative or non-finite size."""
    _check_dims(nbytes=nbytes, flops=flops)
    t_mem = nbytes / (memory_gbps * 1e9 * params.memory_efficiency) if nbytes else 0.0
    t_fl = flops / (peak_flops * params.gemm_efficiency) if flops else 0.0
    return max(t_mem, t_fl) + params.launch_s
