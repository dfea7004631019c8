"""``labkit doctor``: what this machine offers the lab (versions, backends, GPUs, cores, working collectives)."""

from __future__ import annotations

NAME = "doctor"
HELP = "show torch version, backends, GPUs and cores, and probe which collectives work (tiny launch)"


def add_arguments(p) -> None:
    p.add_argument("--world-size", type=int, default=2, help="ranks for the collective probe (default 2)")
    p.add_argument("--no-probe", action="store_true", help="skip the launch that probes collectives")
    p.add_argument("--timeout", type=float, default=60.0, help="probe launch timeout in seconds (default 60)")


def run(args) -> int:
    import os
    import platform

    from labkit.checks import positive_float, positive_int
    from labkit.runtime.limits import check_world_size

    ws = positive_int("--world-size", args.world_size)
    timeout = positive_float("--timeout", args.timeout)
    if not args.no_probe:  # refused before anything is imported or started (override: $LABKIT_MAX_WORLD_SIZE)
        check_world_size(ws, name="--world-size")

    import pandas as pd
    import torch
    import torch.distributed as dist

    from labkit.experiments import probe_collectives
    from labkit.runtime.launcher import launch, resolve_backend
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = [torch.cuda.get_device_name(i) for i in range(n_gpus)]
    print(f"python        {platform.python_version()} ({platform.platform()})")
    print(f"torch         {torch.__version__}")
    print(f"cpu cores     {os.cpu_count()}")
    print(f"gpus          {len(gpus)}" + (f": {', '.join(gpus)}" if gpus else ""))
    backends = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available()}
    print("backends      " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in backends.items()))
    print(f"launch auto   -> {resolve_backend('auto', ws)} for world_size={ws}")
    if args.no_probe:
        return 0
    failed = False
    targets = [("gloo", ws)] + ([("nccl", min(ws, len(gpus)))] if gpus and backends["nccl"] else [])
    for backend, n in targets:
        res = launch(probe_collectives, n, backend=backend, timeout_s=timeout, echo=False)
        df = pd.DataFrame(list(res), index=[f"rank {r}" for r in range(n)]).T
        print(f"\ncollectives on {backend}, world_size={n} (measured: ran and values checked), {res.wall_s:.1f} s:")
        print(df.to_string())
        failed |= bool(((df != "ok") & ~df.apply(lambda c: c.str.startswith("skipped"))).to_numpy().any())
    return 1 if failed else 0
