"""The result of a prediction: :class:`MemoryEstimate` (bytes per category, the verdict against a device of
data/hardware.yaml, the assumptions), its text table, and the helpers every budget shares.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from labkit.checks import check_choice, positive_float, positive_int
from labkit.paths import data_dir
from labkit.theory.memory.conventions import CATEGORIES, DEFAULT_GPU_WORKSPACE_BYTES, GB, GiB
from labkit.theory.spec import ModelSpec, get_spec
from labkit.yamlload import load_path


# ------------------------------------------------------------------------------------------------------
# devices
# ------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def _load_hardware(path: str) -> dict:
    return load_path(path) or {}  # PyYAML (libyaml when built), else labkit.yamlload's reader


def devices() -> dict[str, dict]:
    """Device entries of ``data/hardware.yaml`` (``devices:``): name -> {memory_bytes, source, ...}."""
    raw = _load_hardware(str(data_dir() / "hardware.yaml"))
    return {k: dict(v) for k, v in (raw.get("devices") or {}).items() if isinstance(v, dict) and "memory_bytes" in v}


def usable_bytes(dev: dict) -> int:
    """The bytes a program can use on device ``dev`` (a :func:`get_device` dict): its ``usable_memory_bytes``
    from data/hardware.yaml — what CUDA reports as the device's total memory (``cudaDeviceProp::totalGlobalMem``,
    torch's ``get_device_properties().total_memory``), read from a published deviceQuery output cited there;
    it excludes what the driver reserves, ~0.8 GiB on an 80 GiB part — else the datasheet ``memory_bytes``."""
    return int(dev.get("usable_memory_bytes") or dev["memory_bytes"])


def capacity_note(dev: dict) -> str:
    """One phrase saying which capacity the verdict uses for ``dev`` and where it comes from."""
    usable = usable_bytes(dev)
    if usable == int(dev["memory_bytes"]):
        return f"{usable / GiB:.2f} GiB (datasheet; no program-visible figure recorded)"
    return (f"{usable / GiB:.2f} GiB program-visible of {int(dev['memory_bytes']) / GiB:.0f} GiB datasheet "
            f"({dev.get('usable_memory_source', 'data/hardware.yaml')})")


def get_device(name: str) -> dict:
    """The device ``name`` from data/hardware.yaml; ValueError listing the valid names."""
    table = devices()
    if name not in table:
        raise ValueError(f"unknown device {name!r}; valid devices: {', '.join(sorted(table))}")
    return {"name": name, **table[name]}


# ------------------------------------------------------------------------------------------------------
# the estimate
# ------------------------------------------------------------------------------------------------------
@dataclass
class MemoryEstimate:
    """A predicted budget for one rank (the most loaded one).

    ``categories``: name -> bytes (every name of :data:`CATEGORIES`, 0 when it does not apply);
    ``n_params`` (whole model), ``n_params_local`` (held by this rank before ZeRO sharding), ``stage``
    (the pipeline rank reported: the one with the highest peak), ``per_stage`` (peak bytes of every stage),
    ``device`` / ``device_bytes`` / ``fits`` (None without a device; ``device_bytes`` is the program-visible
    capacity, :func:`usable_bytes`), ``assumptions`` (every choice made).
    """

    mode: str
    categories: dict[str, int]
    n_params: int
    n_params_local: int
    assumptions: dict
    stage: int = 0
    per_stage: list[int] = field(default_factory=list)
    device: str | None = None
    device_bytes: int | None = None
    details: dict = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        """The peak: the sum of every category (headroom included)."""
        return int(sum(self.categories.values()))

    @property
    def fits(self) -> bool | None:
        """Whether the peak fits the device's memory (None without a device)."""
        return None if self.device_bytes is None else self.total_bytes <= self.device_bytes

    @property
    def model_state_bytes(self) -> int:
        """Parameters + gradients + optimizer state, bytes (no activations, buffers, workspace or headroom)."""
        return sum(self.categories[c] for c in ("parameters", "gradients", "optimizer"))

    def verdict(self) -> str:
        """One line: the predicted peak, and whether it fits the device (for a bare parameter count, a lower
        bound: model states only)."""
        unit, div = ("GiB", GiB) if self.total_bytes >= GiB // 10 else ("MiB", 2**20)
        if self.assumptions.get("model_states_only"):
            peak = f"at least {self.total_bytes / div:.2f} {unit} per rank (model states only)"
        else:
            peak = f"peak {self.total_bytes / div:.2f} {unit} per rank"
        if self.device_bytes is None:
            return f"{peak} (no device given)"
        word = "fits" if self.fits else "does NOT fit"
        return (f"{peak}: {word} on {self.device} ({self.device_bytes / GiB:.1f} GiB usable; "
                f"{'free' if self.fits else 'short'} {abs(self.device_bytes - self.total_bytes) / GiB:.2f} GiB)")

    def to_dict(self) -> dict:
        """Plain data (JSON-able): categories, total_bytes, n_params, fits and the assumptions used."""
        return {"mode": self.mode, "categories": dict(self.categories), "total_bytes": self.total_bytes,
                "n_params": self.n_params, "n_params_local": self.n_params_local, "fits": self.fits,
                "device": self.device, "device_bytes": self.device_bytes, "stage": self.stage,
                "per_stage_bytes": list(self.per_stage), "assumptions": self.assumptions}

    def table(self, unit: str = "GiB") -> str:
        """The categories as an aligned text table (``unit``: GiB, GB, MiB or bytes)."""
        return format_table(self, unit)


_UNITS = {"GiB": GiB, "GB": GB, "MiB": 2**20, "MB": 10**6, "bytes": 1}


def format_table(est: MemoryEstimate, unit: str = "GiB") -> str:
    """``est`` as aligned text: a title line saying the numbers are *predicted* per rank (mode, pipeline
    stage, unit), one line per category of :data:`CATEGORIES` ("not estimated" for what a bare parameter
    count cannot tell: activations, temporary and communication buffers), the total and the verdict. ``unit``:
    ``GiB`` (2**30), ``GB`` (10**9), ``MiB``, ``MB`` or ``bytes`` (exact, with thousands separators); other
    units print 3 decimals. Raises ValueError for an unknown unit."""
    check_choice("unit", unit, _UNITS)
    div = _UNITS[unit]
    fmt = (lambda v: f"{v:,d}") if unit == "bytes" else (lambda v: f"{v / div:,.3f}")
    states_only = bool(est.assumptions.get("model_states_only"))
    unknown = {"activations", "temporary", "communication"} if states_only else set()
    rows = [(c, est.categories[c]) for c in CATEGORIES]
    rows.append(("total (lower bound)" if states_only else "total (peak)", est.total_bytes))
    w = max([len(fmt(v)) for _, v in rows] + [len("not estimated")] * bool(unknown))
    what = "model states only" if states_only else est.mode
    lines = [f"predicted memory per rank ({what}, pipeline stage {est.stage}), {unit}"]
    nw = max(len(name) for name, _ in rows)
    lines += [f"  {name:<{nw}s} {'not estimated' if name in unknown else fmt(v):>{w}s}" for name, v in rows]
    lines.append(f"  {est.verdict()}")
    return "\n".join(lines)


def _resolve_model(model) -> ModelSpec | int:
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        return get_spec(model)
    if isinstance(model, (int, float)) and not isinstance(model, bool):
        if positive_float("n_params", model) < 1:
            raise ValueError(f"n_params={model!r} must be a parameter count >= 1 (e.g. 7.5e9)")
        return int(model)
    raise ValueError(f"model={model!r} must be a ModelSpec, a preset name or a parameter count")


def _finish(cats: dict[str, int], headroom: float) -> dict[str, int]:
    sub = sum(v for k, v in cats.items() if k != "headroom")
    cats["headroom"] = int(round(sub * headroom))
    return {c: int(cats.get(c, 0)) for c in CATEGORIES}


def _device_info(device: str | None, workspace_bytes: int | None):
    dev = get_device(device) if device else None
    if workspace_bytes is None:
        workspace_bytes = DEFAULT_GPU_WORKSPACE_BYTES if dev else 0
    positive_int("workspace_bytes", workspace_bytes, minimum=0)
    return dev, int(workspace_bytes)
