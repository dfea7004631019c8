"""Where a launch listens: the rendezvous store on a socket labkit binds itself, the backends on loopback.

torch's ``TCPStore(host, port, is_master=True)`` binds its listening socket to *every* interface whatever
``host`` says (with libuv and without), so a store on ``127.0.0.1`` is reachable from any host that can
reach the machine, unauthenticated. Handing it a socket already bound and listening
(``master_listen_fd``, torch >= 2.0, both store back ends; torch owns the descriptor afterwards) keeps it
where we bound it:

* :func:`labkit.launch` and :class:`labkit.Pool` (one host): ``127.0.0.1``, port chosen by the OS; gloo and
  NCCL are pinned to the loopback interface too (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``, else gloo
  listens on the address the host name resolves to);
* ``labkit.runtime.worker`` started with ``MASTER_ADDR``/``MASTER_PORT`` but without torchrun's agent store
  (e.g. one ``srun`` task per rank): rank 0 binds ``MASTER_ADDR`` — the address the user named — only.
  Under torchrun the store belongs to torchrun's agent (its ``--master-addr`` / ``--rdzv-endpoint``), outside
  labkit; single-node torchrun runs still get gloo/NCCL on loopback.

tests/test_hardening.py lists every listening socket of a launch's processes and checks each is on loopback.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket


def listen_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: the OS picks) and listening. Raises OSError."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    if not infos:
        raise OSError(f"cannot resolve {host!r}")
    family, _, _, _, addr = infos[0]
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(1024)
    except BaseException:
        s.close()
        raise
    return s


def master_store(host: str, port: int, world_size: int, timeout_s: float):
    """The store's server, on a socket bound to ``host`` only. Returns ``(store, port)``."""
    import torch.distributed as dist

    sock = listen_socket(host, port)
    port = sock.getsockname()[1]
    fd = sock.detach()  # torch takes ownership of the descriptor (it closes it with the store)
    store = dist.TCPStore(host, port, world_size, True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=fd)
    return store, port


def client_store(host: str, port: int, world_size: int, timeout_s: float):
    import torch.distributed as dist

    return dist.TCPStore(host, port, world_size, False, timeout=datetime.timedelta(seconds=timeout_s))


def loopback_interface() -> str | None:
    """Name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS), or None."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return None


def pin_to_loopback(env: dict) -> dict:
    """Set gloo's and NCCL's socket interface to loopback in ``env`` (single-host runs). Returns ``env``."""
    lo = loopback_interface()
    if lo is not None:
        env["GLOO_SOCKET_IFNAME"] = lo
        env["NCCL_SOCKET_IFNAME"] = lo
    return env


def is_loopback(address: str) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback (``::ffff:127.0.0.1``)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def listening_addresses(pid: int | None = None) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket process ``pid`` (default: this one) listens on (Linux /proc)."""
    pid = os.getpid() if pid is None else pid
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return []
    out = []
    for table, v6 in (("tcp", False), ("tcp6", True)):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 10 or cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = cols[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if v6:
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                addr = str(ipaddress.IPv6Address(raw))
            else:
                addr = str(ipaddress.IPv4Address(raw[::-1]))
            out.append((addr, int(hexport, 16)))
    return out
