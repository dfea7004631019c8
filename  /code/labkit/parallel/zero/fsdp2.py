"""torch's sharded data parallelism: FSDP2, ``torch.distributed.fsdp.fully_shard`` — ZeRO stage 3
(Rajbhandari et al. 2020) as torch ships it, beside the lab's :class:`~labkit.parallel.zero.ZeroDataParallel`.

:func:`fsdp2` applies ``fully_shard`` bottom-up (each layer, then the root) on a DeviceMesh and builds the
optimizer after sharding, after checking that the parameters are on the device the process group's backend
serves (:func:`check_fsdp_devices`, which the hand-written ZeRO runs too). Each parameter becomes a DTensor
sharded on dim 0: ceil(dim0/n) rows per rank (``torch.chunk``), the last ranks fewer.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn

from labkit.models import make_optimizer

#: the backend each device type needs (the process group's collectives run on tensors of this device)
BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda"}


def check_fsdp_devices(module: nn.Module, device_type: str, backend: str, what: str = "FSDP2") -> None:
    """Raise ValueError unless the process group's backend serves ``device_type`` and every parameter and
    buffer of ``module`` is on that device type.

    The field case (pytorch/pytorch#132471): ``fully_shard`` with a gloo group on a machine with GPUs moves
    the parameters to CUDA and then runs gloo collectives on CUDA tensors — a segfault instead of an error.
    gloo runs on ``cpu`` tensors, nccl on ``cuda`` tensors (``BACKEND_DEVICE``).
    """
    expected = BACKEND_DEVICE.get(backend)
    if expected is not None and device_type != expected:
        raise ValueError(f"{what}: device_type={device_type!r} does not match backend={backend!r}, which runs on "
                         f"{expected!r} tensors; valid: " + ", ".join(f"{d!r} with {b!r}" for b, d in
                                                                  BACKEND_DEVICE.items()))
    for kind, items in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, t in items:
            if t.device.type != device_type:
                raise ValueError(
                    f"{what}: {kind} {name!r} is on {t.device}, but the {backend!r} process group runs on "
                    f"{device_type!r} tensors; move the model first (model.to({device_type!r})) or use a "
                    f"backend for {t.device.type!r} (valid: " + ", ".join(f"{b!r} for {d!r}" for b, d in
                                                                         BACKEND_DEVICE.items()) + ")")


def fsdp2(module: nn.Module, ctx=None, *, lr: float = 1e-3, weight_decay: float = 0.0, mesh=None,
          reshard_after_forward: bool | None = None, mp_policy=None, group=None):
    """Shard ``module`` with FSDP2: ``fully_shard`` on each of ``module.layers`` (a list, or a ``ModuleDict``
    as a pipeline stage holds them) then on the root, on
    ``mesh`` (default: a 1-D mesh of the whole world on ``ctx.device.type``, or CPU without a ctx); then build
    the lab's AdamW (``lr``, ``weight_decay``) over the sharded (DTensor) parameters. Returns (module,
    optimizer). ``mp_policy``: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` for every ``fully_shard``
    call (the hand-written ZeRO-3 takes the same object). Parameters with ``requires_grad=False`` are sharded
    but get no gradient, so AdamW (weight decay included) never changes them.

    ``reshard_after_forward`` None (default) leaves FSDP2's own choice: layers free their gathered
    parameters after forward, the root keeps them until backward (as the lab's ZeRO-3 does); True or False
    forces it on every unit, the root included.

    Raises ValueError (via :func:`check_fsdp_devices`) if the parameters are not on the device the
    backend serves, instead of letting gloo crash on CUDA tensors.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if group is not None:
        raise ValueError("fsdp2 takes a DeviceMesh (mesh=...), not a process group")
    device_type = mesh.device_type if mesh is not None else (ctx.device.type if ctx is not None else "cpu")
    backend = dist.get_backend(mesh.get_group() if mesh is not None else None)
    check_fsdp_devices(module, device_type, backend)
    if mesh is None:
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    mp = {} if mp_policy is None else {"mp_policy": mp_policy}
    layers = getattr(module, "layers", [])
    for layer in layers.values() if isinstance(layers, nn.ModuleDict) else layers:  # a pipeline stage's ModuleDict
        fully_shard(layer, mesh=mesh, reshard_after_forward=True if reshard_after_forward is None
                    else reshard_after_forward, **mp)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, **mp)
    return module, make_optimizer(module.parameters(), lr, weight_decay=weight_decay)
