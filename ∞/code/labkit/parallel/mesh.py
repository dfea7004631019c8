"""The torch DeviceMesh of a :class:`labkit.theory.mesh.ParallelDims`: the same rank grid, as torch groups.

:mod:`labkit.theory.mesh` says which ranks share a group (pure Python, no torch); this is where the grid becomes
process groups, inside a rank.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from labkit.theory.mesh import ParallelDims


def device_mesh(dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh:
    """A ``torch.distributed.device_mesh.DeviceMesh`` of shape ``dims.mesh_shape`` named ``dims.mesh_dim_names``
    (``("pp", "dp", "cp", "tp")`` by default; size-1 dims included so ``mesh["tp"]`` always exists). Call it
    inside a rank (the default process group must exist); every rank calls it. ``init_device_mesh`` numbers
    ranks row-major over the shape, so ``mesh[dim]``'s groups are ``dims.groups(dim)``. Expert groups are not
    mesh dimensions: take them from ``dims.groups("ep")``.

    Raises ValueError when the process group's world size differs from ``dims.world_size``.
    """
    if dist.is_initialized() and dist.get_world_size() != dims.world_size:
        raise ValueError(f"the process group has world_size={dist.get_world_size()} but these dims need "
                         f"world_size={dims.world_size}; launch {dims.world_size} ranks")
    return init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=dims.mesh_dim_names)
