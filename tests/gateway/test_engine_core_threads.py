"""An engine core's torch threads: every core the process may use unless the operator
says otherwise; the server's own process keeps one."""

from __future__ import annotations

import os

from gateway.config import ServerConfig
from gateway.engine_core import with_core_threads


def test_auto_threads_in_a_core_are_the_cores_the_process_may_use():
    cfg = ServerConfig()
    assert cfg.torch_threads is None  # the default is auto
    assert with_core_threads(cfg).torch_threads == len(os.sched_getaffinity(0))


def test_an_explicit_thread_count_is_kept():
    assert with_core_threads(ServerConfig(torch_threads=3)).torch_threads == 3
