"""What :class:`~labkit.parallel.zero.wrapper.ZeroDataParallel` checks and casts around its units: the
``ignored_params`` argument, the optimizer a user builds (checked at its first ``step()``), mixed-precision
casts of a unit's inputs and outputs."""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn


def cast_floating(x, dtype):
    """Floating tensors in ``x`` (a tensor, or nested tuples / lists / dicts of them) cast to ``dtype``."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (tuple, list)):
        return type(x)(cast_floating(v, dtype) for v in x)
    if isinstance(x, dict):
        return {k: cast_floating(v, dtype) for k, v in x.items()}
    return x


def check_ignored(module: nn.Module, ignored_params) -> set:
    """``ignored_params`` as a set of ``module``'s parameters (empty for None). Raises ValueError for a tensor
    that is not one of them, and TypeError for something that is not an iterable of parameters."""
    if ignored_params is None:
        return set()
    if isinstance(ignored_params, torch.Tensor):
        ignored_params = [ignored_params]
    try:
        chosen = list(ignored_params)
    except TypeError:
        raise TypeError(f"ignored_params={ignored_params!r} must be an iterable of the module's parameters") from None
    mine = {p: q for q, p in module.named_parameters(remove_duplicate=False)}
    for p in chosen:
        if not isinstance(p, torch.Tensor) or p not in mine:
            what = f"a tensor of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else repr(p)
            raise ValueError(f"ignored_params holds {what}, which is not a parameter of the wrapped module; give "
                             "parameters of module.parameters() (e.g. [model.norm.weight])")
    return set(chosen)


def optimizer_guard(z):
    """A global ``register_optimizer_step_pre_hook``: the first ``step()`` of each optimizer checks that it
    holds the parameters this wrapper expects (``ZeroDataParallel._check_optimizer``)."""
    ref = weakref.ref(z)

    def hook(optimizer, _args, _kwargs):
        w = ref()
        if w is None or optimizer in w._checked:
            return
        w._check_optimizer(optimizer)
        w._checked.add(optimizer)

    return hook
