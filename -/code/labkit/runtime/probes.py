"""What this host offers, read from the operating system: cores, memory, bytes a process wrote.

No torch and no pandas here: a rank, the launcher and a chapter's checks all read these cheaply.
"""

from __future__ import annotations

import os


def cpu_cores() -> int:
    """Cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def socket_bytes_written() -> int | None:
    """Bytes this process has written through write-like system calls (``wchar`` in /proc/self/io; gloo's
    TCP sends are among them). None where /proc/self/io does not exist (not Linux)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (bytes): what can be allocated now without swapping. None where it
    cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _memory_cgroup_dirs() -> list[str]:
    """Folders of this process's memory cgroup (v2 unified, or v1 ``memory`` controller), innermost first,
    then the mount root (containers often mount only their own cgroup there)."""
    out = []
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2
            out.append("/sys/fs/cgroup" + path.rstrip("/"))
        elif "memory" in controllers.split(","):
            out.append("/sys/fs/cgroup/memory" + path.rstrip("/"))
    out += ["/sys/fs/cgroup", "/sys/fs/cgroup/memory"]
    seen, dirs = set(), []
    for d in out:
        if d not in seen and os.path.isdir(d):
            seen.add(d)
            dirs.append(d)
    return dirs


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def cgroup_memory() -> dict:
    """This process's memory cgroup: ``{"limit": bytes or None, "usage": bytes or None, "oom_kill": count or
    None, "path": folder or None}`` (v2 ``memory.max`` / ``memory.current`` / ``memory.events``, v1
    ``memory.limit_in_bytes`` / ``memory.usage_in_bytes`` / ``memory.oom_control``). A limit of "max" or
    >= 2**60 counts as none."""
    for d in _memory_cgroup_dirs():
        limit = _read_int(f"{d}/memory.max")
        usage = _read_int(f"{d}/memory.current")
        events = f"{d}/memory.events"
        if usage is None:
            limit = _read_int(f"{d}/memory.limit_in_bytes")
            usage = _read_int(f"{d}/memory.usage_in_bytes")
            events = f"{d}/memory.oom_control"
        if usage is None and limit is None:
            continue
        oom = None
        try:
            with open(events) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        oom = int(value)
        except (OSError, ValueError):
            pass
        if limit is not None and limit >= 2**60:
            limit = None
        return {"limit": limit, "usage": usage, "oom_kill": oom, "path": d}
    return {"limit": None, "usage": None, "oom_kill": None, "path": None}


def system_oom_kills() -> int | None:
    """Processes the kernel's OOM killer has killed since boot, on the whole machine (``oom_kill`` in
    /proc/vmstat, Linux >= 4.13); None where it cannot be read."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def process_start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, /proc/<pid>/stat field 22), None when it does not
    exist: with the pid it identifies a process even after its pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_alive(pid: int, start_ticks: int | None = None) -> bool:
    """True when ``pid`` runs (and, given ``start_ticks``, is still the process that started then)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if start_ticks is not None:
        now = process_start_ticks(pid)
        return now is None or now == start_ticks
    return True


def host_memory_bytes() -> int | None:
    """Memory of this machine in bytes: ``os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")``, lowered
    to the cgroup's limit when the process runs under one (``/sys/fs/cgroup/memory.max``, cgroup v2, or
    ``memory.limit_in_bytes``, v1: containers, Slurm jobs). None where neither can be read."""
    sizes = []
    try:
        sizes.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        pass
    limit = cgroup_memory()["limit"]
    if limit:
        sizes.append(limit)
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:  # "max" or a huge number: no limit
            sizes.append(int(text))
    sizes = [x for x in sizes if x > 0]
    return min(sizes) if sizes else None
