"""An engine core's torch threads: the cores the process may use less one per front end
(at least one) unless the operator says otherwise; the server's own process keeps one."""

from __future__ import annotations

import os

from gateway.config import ServerConfig
from gateway.cores.proc import with_core_threads


def test_auto_threads_in_a_core_leave_a_core_to_each_front_end(monkeypatch):
    cfg = ServerConfig()
    assert cfg.torch_threads is None  # the default is auto
    assert with_core_threads(cfg).torch_threads == max(1, len(os.sched_getaffinity(0)) - 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert with_core_threads(cfg).torch_threads == 15
    assert with_core_threads(ServerConfig(api_workers=4)).torch_threads == 12
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert with_core_threads(cfg).torch_threads == 1  # never none


def test_an_explicit_thread_count_is_kept():
    assert with_core_threads(ServerConfig(torch_threads=3)).torch_threads == 3
