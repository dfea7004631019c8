"""Weight-only quantization for serving: int8 or int4 weights with one fp16 scale per group of weights,
dequantized on the fly in every forward pass (activations, KV cache and arithmetic stay in the model's
float dtype).

The lab's convention is the memory calculator's (:func:`labkit.theory.memory.infer_memory`): *every*
parameter tensor is quantized (embeddings, norms and biases too), flattened and cut into groups of
:data:`~labkit.theory.memory.QUANT_GROUP` (128) consecutive weights, each group with one fp16 scale
(symmetric absmax: ``scale = max|w| / (2^(bits-1) - 1)``, ``q = round(w / scale)``; the GPTQ/AWQ-style
group layout, Frantar et al. 2023; Lin et al. 2024). int8 keeps one byte per weight; int4 packs two
weights per byte. So the bytes a quantized model holds are, to the byte, the calculator's ``parameters``
for ``weight_dtype="int8"`` / ``"int4"`` (:func:`weight_bytes` measures them).

:func:`quantize` swaps each module's class for a subclass whose parameters are properties that
dequantize (``module.weight`` returns a float tensor), so the serving loop, a tied output layer
(``x @ embed.weight.t()``) and ``F.linear`` / ``F.embedding`` / ``F.rms_norm`` run unchanged.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from labkit.checks import check_choice
from labkit.theory.memory import QUANT_GROUP

BITS = {"int8": 8, "int4": 4}


def quantize_tensor(w: torch.Tensor, bits: int, group: int = QUANT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` (any shape, n elements) -> (q, scale): q int8 [n] (bits 8) or uint8 [ceil(n/2)] (bits 4, two
    4-bit values per byte, low nibble first), scale fp16 [ceil(n/group)]."""
    flat = w.detach().float().reshape(-1)  # (n,)
    n = flat.numel()
    g = -(-n // group)
    grouped = F.pad(flat, (0, g * group - n)).view(g, group)  # (G, group)
    qmax = 2 ** (bits - 1) - 1  # 127 or 7: symmetric, -qmax..qmax
    scale = (grouped.abs().amax(1) / qmax).half()  # (G,) fp16, as stored
    s = scale.float()[:, None]  # (G, 1)
    q = torch.where(s > 0, grouped / s.clamp_min(1e-30), 0.0).round().clamp(-qmax, qmax)  # (G, group)
    q = q.reshape(-1)[:n].to(torch.int8)  # (n,)
    if bits == 4:
        u = F.pad(q + 8, (0, n % 2)).to(torch.uint8).view(-1, 2)  # (ceil(n/2), 2), each 0..15
        q = u[:, 0] | (u[:, 1] << 4)  # (ceil(n/2),) uint8
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, shape, bits: int, dtype=torch.float32,
               group: int = QUANT_GROUP) -> torch.Tensor:
    """The float tensor [shape] that (q, scale) of :func:`quantize_tensor` stand for."""
    n = 1
    for s in shape:
        n *= s
    if bits == 4:
        lo = (q & 15).to(torch.int8) - 8  # (ceil(n/2),)
        hi = (q >> 4).to(torch.int8) - 8
        q = torch.stack((lo, hi), -1).reshape(-1)[:n]  # (n,) int8
    g = scale.numel()
    vals = F.pad(q.to(dtype), (0, g * group - n)).view(g, group) * scale.to(dtype)[:, None]  # (G, group)
    return vals.reshape(-1)[:n].view(*shape)


_CLASSES: dict = {}


def _quant_class(cls: type, names: tuple[str, ...]) -> type:
    """A subclass of ``cls`` whose parameters ``names`` are read-only properties that dequantize."""
    key = (cls, names)
    if key not in _CLASSES:
        def prop(name):
            def get(self):
                shape, bits, dtype = self._quant[name]
                return dequantize(self._buffers[f"{name}_q"], self._buffers[f"{name}_scale"], shape, bits, dtype)
            return property(get)

        _CLASSES[key] = type(f"Quant{cls.__name__}", (cls,), {n: prop(n) for n in names})
    return _CLASSES[key]


def quantize(model: nn.Module, weight_dtype: str = "int8") -> nn.Module:
    """A weight-only quantized copy of ``model`` (``model`` itself is left as it is): every parameter
    becomes buffers ``<name>_q`` and ``<name>_scale`` (see the module docstring); reading ``<name>``
    dequantizes. ``weight_dtype``: "int8" or "int4". The copy has ``quant = {"weight_dtype", "bits",
    "group"}``. Raises ValueError for another weight_dtype."""
    check_choice("weight_dtype", weight_dtype, tuple(BITS))
    bits = BITS[weight_dtype]
    out = copy.deepcopy(model)
    for mod in out.modules():
        names = tuple(n for n, p in mod._parameters.items() if p is not None)
        if not names:
            continue
        mod._quant = {}
        for name in names:
            p = mod._parameters.pop(name)
            q, s = quantize_tensor(p.data, bits)
            mod.register_buffer(f"{name}_q", q)
            mod.register_buffer(f"{name}_scale", s)
            mod._quant[name] = (tuple(p.shape), bits, p.dtype)
        mod.__class__ = _quant_class(type(mod), names)
    out.quant = {"weight_dtype": weight_dtype, "bits": bits, "group": QUANT_GROUP}
    return out.eval()


def weight_bytes(model: nn.Module) -> int:
    """Measured: bytes of the model's weights as stored — every parameter, and a quantized model's
    ``*_q`` / ``*_scale`` buffers (other buffers, such as the RoPE tables, are not weights)."""
    total = sum(p.untyped_storage().nbytes() for p in model.parameters())
    for mod in model.modules():
        for name in getattr(mod, "_quant", {}):
            total += sum(mod._buffers[f"{name}{s}"].untyped_storage().nbytes() for s in ("_q", "_scale"))
    return total
