"""gateway/cores/launch.py: a child runs a Ferry function in a fresh interpreter, never the
parent's main module, and says why when it dies."""

from __future__ import annotations

import os
import socket
import sys
from typing import Any

from gateway.cores.launch import Child


def echo(conn: Any, greeting: str) -> None:
    """Answers one message, with what this process knows of itself."""
    message = conn.recv()
    main = sys.modules["__main__"]
    conn.send((greeting, message, os.getpid(), getattr(main, "__spec__", None) and main.__spec__.name))


def fail_loading(conn: Any) -> None:
    raise RuntimeError("weights file truncated at byte 123")


def exit_with(conn: Any, code: int) -> None:
    sys.exit(code)


def serve_once(conn: Any, fd: int) -> None:
    """Accepts one connection on the inherited listening socket and writes to it."""
    with socket.socket(fileno=fd) as sock:
        peer, _ = sock.accept()
        with peer:
            peer.sendall(b"from the child")


def test_runs_the_target_with_its_pipe_and_never_the_parents_main() -> None:
    child = Child(echo, ("hello",), name="ferry-test-echo")
    try:
        child.conn.send("ping")
        greeting, message, pid, main = child.conn.recv()
        assert (greeting, message, pid) == ("hello", "ping", child.pid)
        assert main == "gateway.cores.launch"  # its main module is Ferry's, not pytest's or a script's
        child.join(30)
        assert child.exitcode == 0 and not child.is_alive()
        assert child.last_words() is None
    finally:
        child.kill()
        child.join()
        child.close()


def test_a_child_that_raises_leaves_its_reason() -> None:
    child = Child(fail_loading, name="ferry-test-fail")
    child.join(30)
    assert child.exitcode == 1
    assert child.last_words() == "RuntimeError: weights file truncated at byte 123"
    child.close()


def test_exit_codes_and_signals_read_as_multiprocessing_reads_them() -> None:
    child = Child(exit_with, (3,), name="ferry-test-exit")
    child.join(30)
    assert child.exitcode == 3 and child.last_words() is None
    child.close()
    child = Child(echo, ("never answered",), name="ferry-test-kill")
    assert child.is_alive()
    child.kill()
    child.join(30)
    assert child.exitcode == -9
    child.close()


def test_the_sentinel_turns_readable_when_the_child_is_gone() -> None:
    import select

    child = Child(echo, ("x",), name="ferry-test-sentinel")
    assert select.select([child.sentinel], [], [], 0)[0] == []  # alive: nothing to read
    child.conn.send("bye")
    child.conn.recv()
    assert select.select([child.sentinel], [], [], 30)[0] == [child.sentinel]
    child.join(30)
    child.close()


def test_an_inherited_listening_socket_serves_in_the_child() -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        child = Child(serve_once, (sock.fileno(),), name="ferry-test-socket", pass_fds=(sock.fileno(),))
        with socket.create_connection(sock.getsockname(), timeout=30) as client:
            assert client.recv(100) == b"from the child"
    child.join(30)
    assert child.exitcode == 0
    child.close()


def test_stop_within_kills_a_child_that_does_not_exit_in_time() -> None:
    child = Child(echo, ("never answered",), name="ferry-test-stop")
    alive_before_kill: list[bool] = []
    assert child.stop_within(0.2, 30, before_kill=lambda: alive_before_kill.append(child.is_alive()))
    assert alive_before_kill == [True] and child.exitcode == -9
    child.close()
    child = Child(exit_with, (0,), name="ferry-test-stop-clean")
    assert not child.stop_within(30) and child.exitcode == 0  # exited by itself: not killed
    child.close()
