"""The listening socket of a Ferry server, made one way for every topology: the embedded
gateway's (gateway/embedded.py) and the `--api-workers` supervisor's, which its front ends
share (gateway/cores/supervisor.py)."""

from __future__ import annotations

import socket

# uvicorn's own default; uvicorn listens again on a socket it is handed, with its backlog.
BACKLOG = 2048


def listening_socket(host: str, port: int, *, backlog: int = BACKLOG, inheritable: bool = False) -> socket.socket:
    """A TCP socket bound to host:port (port 0: a free one, read back with getsockname) and
    listening, so the port is claimed at once. SO_REUSEADDR lets a restarted server take a
    port whose old connections linger in TIME_WAIT; a host with a colon ("::1", "::") is
    IPv6. inheritable: for child processes to serve on it (`--api-workers` front ends).

    Raises OSError, its errno kept, whose strerror is one line naming the address:
    "cannot listen on 127.0.0.1:8000: Address already in use"."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(inheritable)
    return sock
