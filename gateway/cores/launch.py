"""Ferry's child processes (engine cores, front ends): a fresh interpreter that runs a Ferry
function, never the user's main module.

multiprocessing's `spawn` starts a child by importing the parent's `__main__` again: an
unguarded script then starts Ferry once more in the child (and fails in its bootstrapping
phase), a script read from standard input or `python -c` cannot be imported at all, and a
notebook kernel's main module is not a file. A `Child` is `python -m gateway.cores.launch` instead:
it reads the parent's `sys.path` and then `(target, args)` from its end of a
`multiprocessing.Pipe`, and calls `target(conn, *args)` with that end. Nothing of the
parent's main module crosses, so embedded mode works from any script, standard input, `-c`,
a notebook, or a thread other than the main one.

A second pipe is the child's life line: the child holds its write end until it exits, so
its read end (`sentinel`) turns readable when the child is gone, as multiprocessing's
sentinel does. A child whose target raises writes the exception's last line there first:
`last_words()` gives whoever saw it die the reason, not only an exit code.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, Pipe
from typing import Any

# Where the `gateway` package lies, so that the child finds it before the parent's sys.path
# arrives (the parent may have found it through a path it added itself).
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The longest reason a child leaves (its last error line).
_LAST_WORDS_BYTES = 4096


class Child:
    """`target(conn, *args)` in a fresh interpreter; `conn` is our end of the pipe to it.
    `args` must pickle; `pass_fds` are file descriptors the child inherits as they are
    (a listening socket's, say). The face callers use is multiprocessing.Process's:
    pid, sentinel, is_alive, join, kill, exitcode; and `stop_within`, how every stop
    waits for a child to exit."""

    def __init__(
        self,
        target: Callable[..., Any],
        args: Sequence[Any] = (),
        *,
        name: str,
        pass_fds: Sequence[int] = (),
    ):
        self.name = name
        self.conn, theirs = Pipe()
        self.sentinel, life = os.pipe()
        self._last_words: str | None = None
        try:
            path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)
            self._popen = subprocess.Popen(
                [sys.executable, "-m", "gateway.cores.launch", name, str(theirs.fileno()), str(life)],
                stdin=subprocess.DEVNULL,  # a script read from stdin stays the parent's
                pass_fds=(theirs.fileno(), life, *pass_fds),
                env={**os.environ, "PYTHONPATH": path},
            )
        except BaseException:
            self.conn.close()
            os.close(self.sentinel)
            raise
        finally:
            theirs.close()  # the child holds the only other ends: its exit closes them
            os.close(life)
        self.pid = self._popen.pid
        # The path first: unpickling (target, args) imports the target's module.
        with contextlib.suppress(OSError):  # died at once: its exit says why
            self.conn.send(list(sys.path))
            self.conn.send_bytes(pickle.dumps((target, tuple(args))))

    @property
    def exitcode(self) -> int | None:
        """None while it runs; its exit status, or -N when signal N ended it."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen.wait(timeout)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self._popen.kill()

    def stop_within(
        self, seconds: float, grace: float | None = None, *, before_kill: Callable[[], None] | None = None
    ) -> bool:
        """Wait up to `seconds` for the child to exit; if it has not, kill it (calling
        `before_kill` first) and wait up to `grace` seconds more (None: until it is gone).
        True when it had to be killed. Blocks: from a loop, run it in a thread."""
        self.join(seconds)
        if not self.is_alive():
            return False
        if before_kill is not None:
            before_kill()
        self.kill()
        self.join(grace)
        return True

    def last_words(self) -> str | None:
        """The last error line the child wrote before it exited, if any (call once it has)."""
        if self._last_words is None and self.sentinel >= 0:
            os.set_blocking(self.sentinel, False)
            with contextlib.suppress(OSError):
                self._last_words = os.read(self.sentinel, _LAST_WORDS_BYTES).decode(errors="replace").strip()
        return self._last_words or None

    def close(self) -> None:
        """Release our ends of its pipes (after it exited)."""
        self.last_words()
        self.conn.close()
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1

    def __repr__(self) -> str:
        return f"<Child {self.name} pid={self.pid} exitcode={self.exitcode}>"


def main(argv: list[str]) -> None:
    """The child's side (`python -m gateway.cores.launch NAME CONN_FD LIFE_FD`): take the parent's
    sys.path, then run the target; if anything fails, leave its reason on the life line and
    exit 1."""
    conn, life = Connection(int(argv[2])), int(argv[3])
    for fd in (conn.fileno(), life):
        os.set_inheritable(fd, False)  # not to the child's own children
    try:
        sys.path[:] = conn.recv()
        target, args = pickle.loads(conn.recv_bytes())
        target(conn, *args)
    except SystemExit:
        raise
    except BaseException as exc:
        traceback.print_exc()
        line = traceback.format_exception_only(type(exc), exc)[-1].strip()
        with contextlib.suppress(OSError):
            os.write(life, line.encode()[-_LAST_WORDS_BYTES:])
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv)
