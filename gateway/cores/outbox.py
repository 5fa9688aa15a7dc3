"""Messages between a front end and an engine core, sent one frame per peer per turn of the
event loop.

Every message a side has for a peer during one turn of its event loop (the Admitted
answers of the requests that arrived together, the Results of one batch, the deltas of one
decode step) travels in one ZMQ frame, `wire.pack`ed in order. Each send costs a system
call and a wake-up of ZMQ's I/O thread, and each asyncio receive a future: measured with
the zero-cost engines (loadtests/bench_gateway.py), the core spent a fifth of its time in
`Socket.send` when it sent one frame per message. The frame leaves at the end of the turn
(`loop.call_soon`), so nothing waits for a timer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from typing import Any

import msgspec


class Outbox:
    """Collects messages by peer; `send(peer, messages)` gets each peer's list once per
    turn of the running loop, in the order they were put."""

    def __init__(self, send: Callable[[Any, list[msgspec.Struct]], None]):
        self._send = send
        self._out: dict[Hashable, list[msgspec.Struct]] = {}
        self._scheduled = False

    def put(self, peer: Hashable, message: msgspec.Struct) -> None:
        messages = self._out.get(peer)
        if messages is not None:
            messages.append(message)
            return
        self._out[peer] = [message]
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Send what was put, now (also called before a socket closes)."""
        self._scheduled = False
        out, self._out = self._out, {}
        for peer, messages in out.items():
            self._send(peer, messages)

    def clear(self) -> list[msgspec.Struct]:
        """Drop what was not sent yet (the socket it was for is gone); returns it."""
        out, self._out = self._out, {}
        return [m for messages in out.values() for m in messages]
