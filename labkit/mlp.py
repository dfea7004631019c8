"""The two MLPs of the lab's transformer layer, below both :mod:`labkit.models` (the dense layer's MLP) and
:mod:`labkit.parallel.expert` (each expert of a mixture-of-experts layer is one of them), so neither imports
the other's module for them."""

from __future__ import annotations

import torch.nn as nn
import torch.nn.functional as F


class SwiGLU(nn.Module):
    """SwiGLU MLP (Shazeer 2020): ``w_down(silu(w_gate(x)) * w_up(x))``. [B, T, H] -> [B, T, H]."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, bias: bool = False):
        super().__init__()
        self.w_gate = nn.Linear(hidden_size, ffn_hidden_size, bias=bias)
        self.w_up = nn.Linear(hidden_size, ffn_hidden_size, bias=bias)
        self.w_down = nn.Linear(ffn_hidden_size, hidden_size, bias=bias)

    def forward(self, x):  # x [B, T, H]
        gate = F.silu(self.w_gate(x))  # [B, T, F]
        return self.w_down(gate * self.w_up(x))  # [B, T, F] -> [B, T, H]


class GeluMLP(nn.Module):
    """GPT-2 MLP: ``fc_out(gelu_tanh(fc_in(x)))``. [B, T, H] -> [B, T, H]."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, bias: bool = True):
        super().__init__()
        self.fc_in = nn.Linear(hidden_size, ffn_hidden_size, bias=bias)
        self.fc_out = nn.Linear(ffn_hidden_size, hidden_size, bias=bias)

    def forward(self, x):  # x [B, T, H]
        return self.fc_out(F.gelu(self.fc_in(x), approximate="tanh"))  # [B, T, F] -> [B, T, H]
