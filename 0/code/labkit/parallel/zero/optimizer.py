"""ZeRO stage 1 as an *optimizer* wrapper: :class:`ShardedOptimizer` (torch's
``torch.distributed.optim.ZeroRedundancyOptimizer`` shape), which stacks on any data-parallel wrapper that
leaves the averaged gradients on every rank (the lab's :class:`~labkit.parallel.data.DataParallelNaive` /
:class:`~labkit.parallel.data.DataParallelBucket`, or torch's ``DistributedDataParallel``).

ZeRO-1 (P_os, Rajbhandari et al. 2020, Sec. 5.1): each rank keeps the optimizer state of only the parameters
it owns. Here the state is sharded *by parameter* (whole tensors, as ZeroRedundancyOptimizer does, not flat
slices as :class:`~labkit.parallel.zero.ZeroDataParallel`): the partition is
:func:`labkit.theory.zero.partition_by_size` (largest first, to the least-loaded rank), so a rank's state
bytes are :func:`labkit.theory.zero.sharded_optimizer_bytes`. ``step()`` runs the wrapped optimizer on the
owned parameters, then every rank broadcasts what it updated (one broadcast per rank and dtype, flat).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.theory.zero import partition_by_size


class ShardedOptimizer(torch.optim.Optimizer):
    """``ShardedOptimizer(params, optimizer_cls, *, group=None, **defaults)``: ZeRO-1 over the ranks of
    ``group`` (default: the world), as ``ZeroRedundancyOptimizer(params, optimizer_class, **defaults)``.

    Args:
        params: an iterable of parameters or of param-group dicts (``{"params": [...], "weight_decay": 0.0}``),
            identical on every rank (same order, same shapes).
        optimizer_cls: the optimizer each rank runs on its own parameters (e.g. ``torch.optim.AdamW``).
        group: the data-parallel process group.
        **defaults: the optimizer's keyword arguments (``lr``, ``weight_decay``, ...), defaults for every group.

    Each parameter with ``requires_grad=True`` is owned by one rank (:func:`labkit.theory.zero.partition_by_size`
    over the groups in order); frozen ones (``requires_grad=False`` at construction, or in a group added later)
    are owned by nobody: never stepped, never broadcast, no state anywhere. ``param_groups`` are the full
    groups (schedulers and ``zero_grad`` work on them; hyperparameters are copied to the local optimizer at each
    step); ``state`` is this rank's shard of the state. ``step()`` steps the owned parameters and broadcasts
    them from their owner, so every replica ends equal. ``state_dict()`` / ``load_state_dict()`` hold this
    rank's shard only (ZeroRedundancyOptimizer gathers a full one with ``consolidate_state_dict``).

    The gradients must already be averaged over the group when ``step()`` runs (a DDP wrapper does it).
    Raises ValueError if ``optimizer_cls`` is not an optimizer class.
    """

    def __init__(self, params, optimizer_cls, *, group=None, **defaults):
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise ValueError(f"optimizer_cls={optimizer_cls!r} must be a torch.optim.Optimizer subclass, "
                             "e.g. torch.optim.AdamW")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.optimizer_cls = optimizer_cls
        self._optimizer_defaults = dict(defaults)
        self._sizes = [0] * self.world_size
        self.owner: dict[torch.Tensor, int] = {}  # trainable parameter -> the rank that steps it
        self._local: torch.optim.Optimizer | None = None
        self._local_group: list[int | None] = []  # my group index -> the local optimizer's, or None
        self._empty_state: dict = {}
        super().__init__(params, defaults)

    # torch.optim.Optimizer assigns ``self.state`` in its __init__; the state that exists is the local one
    @property
    def state(self):
        return self._local.state if self._local is not None else self._empty_state

    @state.setter
    def state(self, value):
        self._empty_state = value

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (also called by the constructor for each group): its trainable parameters are
        partitioned, continuing the running sizes; this rank's share joins the local optimizer."""
        super().add_param_group(param_group)
        g = self.param_groups[-1]
        numels = [p.numel() if p.requires_grad else None for p in g["params"]]
        owners = partition_by_size([numels], self.world_size, start_sizes=self._sizes)[0]
        for p, r in zip(g["params"], owners):
            if r is not None:
                self.owner[p] = r
                self._sizes[r] += p.numel()
        mine = [p for p, r in zip(g["params"], owners) if r == self.rank]
        if not mine:
            self._local_group.append(None)
            return
        local_group = {**{k: v for k, v in g.items() if k != "params"}, "params": mine}
        if self._local is None:
            self._local = self.optimizer_cls([local_group], **self._optimizer_defaults)
        else:
            self._local.add_param_group(local_group)
        self._local_group.append(len(self._local.param_groups) - 1)

    def local_optimizer(self) -> torch.optim.Optimizer | None:
        """The wrapped optimizer over this rank's parameters (None if it owns none)."""
        return self._local

    def owned_parameters(self, rank: int | None = None) -> list[torch.Tensor]:
        """The parameters ``rank`` (default: this rank) steps, in param-group order."""
        rank = self.rank if rank is None else rank
        return [p for g in self.param_groups for p in g["params"] if self.owner.get(p) == rank]

    @torch.no_grad()
    def step(self, closure=None):
        """Step the owned parameters with the wrapped optimizer, then broadcast every rank's updated
        parameters from it (collective on the group). Returns the closure's loss, if one was given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._local is not None:
            for g, j in zip(self.param_groups, self._local_group):
                if j is not None:
                    self._local.param_groups[j].update({k: v for k, v in g.items() if k != "params"})
            self._local.step()
        self._broadcast()
        return loss

    def _broadcast(self) -> None:
        for r in range(self.world_size):
            params = self.owned_parameters(r)
            src = dist.get_global_rank(self.group, r) if self.group is not None else r
            for dtype in sorted({p.dtype for p in params}, key=str):
                ps = [p for p in params if p.dtype == dtype]
                if r == self.rank:
                    flat = torch.cat([p.detach().reshape(-1) for p in ps])  # [sum numel]: what this rank updated
                else:
                    flat = torch.empty(sum(p.numel() for p in ps), dtype=dtype, device=ps[0].device)  # [sum numel]
                dist.broadcast(flat, src=src, group=self.group)  # [sum numel], from the owner
                if r != self.rank:
                    off = 0
                    for p in ps:
                        p.copy_(flat[off:off + p.numel()].view_as(p))  # p.shape <- the owner's update
                        off += p.numel()

    def state_dict(self) -> dict:
        """This rank's shard: the local optimizer's state dict, with the group hyperparameters and who owns
        what (``rank``, ``world_size``)."""
        return {"rank": self.rank, "world_size": self.world_size,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
                "local": None if self._local is None else self._local.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a :meth:`state_dict` saved by the same rank of the same world size. Raises ValueError
        otherwise."""
        if (state_dict.get("rank"), state_dict.get("world_size")) != (self.rank, self.world_size):
            raise ValueError(f"state_dict of rank {state_dict.get('rank')} of {state_dict.get('world_size')} "
                             f"cannot load into rank {self.rank} of {self.world_size}: a ShardedOptimizer state is "
                             "per rank")
        for g, saved in zip(self.param_groups, state_dict["param_groups"]):
            g.update(saved)
        if self._local is not None and state_dict["local"] is not None:
            self._local.load_state_dict(state_dict["local"])

