"""Metrics across the processes of one server with several front ends (`--api-workers N`).

The front ends and the supervisor keep their series in files of one directory,
`<run dir>/metrics` (`metrics_dir`), prometheus-client's multiprocess mode: each process
writes its own values to files named after its pid, and a /metrics scrape of any front end
reads every file there (`shared_registry`, a `MultiProcessCollector`), so the counters and
histograms of every front end that ever ran in this server are summed: those of a front end
that died (SIGKILL, OOM kill) and was replaced stay in, and `ferry_requests_total` and
`ferry_request_duration_seconds` never go down while the server runs (a drop would read as a
counter reset to Prometheus, and rate() would show a spike that never happened). The cores'
series are merged in beside them as with one front end (gateway/metrics/merge.py); a core
keeps its batching series in its own registry (it never writes here), so a restarted core's
counters start at zero, an ordinary counter reset that rate() handles.

- A front end (`share_metrics`, first thing in its process) turns multiprocess mode on for
  the whole process before any metric exists: `PROMETHEUS_MULTIPROC_DIR` and
  `prometheus_client.values.ValueClass`, which each metric reads when it is made.
- The supervisor (`SupervisorMetrics`) keeps its one series,
  `ferry_engine_core_restarts_total`, in a file of its own there without turning the mode on
  for its process: in embedded mode it is a thread of the caller's process, whose other
  metrics (and the engine cores it spawns, which inherit its environment) must stay as they
  are.
- When a front end exits, the supervisor marks it dead (`process_gone`): its live gauges
  (`ferry_requests_in_flight`, `ferry_jobs`, whose multiprocess modes are `livesum` and
  `livemax`, batcher/metrics.py) leave the scrape; its counters and histograms stay.

Multiprocess mode keeps no `_created` sample for counters and histograms.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from prometheus_client import CollectorRegistry, values
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from batcher.metric_types import Counter

from .registry import CORE_RESTARTS


def metrics_dir(run_dir: str) -> str:
    """Where the front ends and the supervisor of one server keep their series."""
    return os.path.join(run_dir, "metrics")


def share_metrics(path: str) -> None:
    """Every metric this process makes from now on keeps its values in `path` (a front end's
    first step, before any metric exists: each reads `ValueClass` when it is made)."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    values.ValueClass = values.MultiProcessValue()


def shared_registry(path: str) -> CollectorRegistry:
    """A registry whose collect() reads the series of every process that wrote to `path`,
    the dead included (their live gauges excepted)."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path)
    return registry


def process_gone(pid: int, path: str) -> None:
    """A front end exited: its live gauges leave the scrape, its counters stay."""
    mark_process_dead(pid, path)


class SupervisorMetrics:
    """The supervisor's `ferry_engine_core_restarts_total` (gateway/cores/process.py's
    `CoreRestarter` counts a core's restarts in it), written to `path` in the file format of
    multiprocess mode under the supervisor's pid, so the front ends' scrapes read it."""

    def __init__(self, path: str):
        self._files: dict[str, MmapedDict] = {}
        value_class = _file_values(path, self._files)
        counter = type("SharedCounter", (_FileCounter,), {"value_class": value_class})
        self.core_restarts: Counter = counter(*CORE_RESTARTS, ["model"], registry=None)

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


class _FileCounter(Counter):
    value_class: Any

    def _metric_init(self) -> None:  # prometheus_client.Counter's, with our value class
        self._value = self.value_class(
            self._type, self._name, self._name + "_total", self._labelnames, self._labelvalues, self._documentation
        )
        self._created = time.time()


def _file_values(path: str, files: dict[str, MmapedDict]) -> type:
    """A value class like multiprocess mode's (values.MultiProcessValue), writing to `path`
    rather than to the directory the process environment names."""
    lock = threading.Lock()

    class FileValue:
        _multiprocess = True

        def __init__(self, typ, metric_name, name, labelnames, labelvalues, help_text, multiprocess_mode="", **_):
            prefix = f"gauge_{multiprocess_mode}" if typ == "gauge" else typ
            with lock:
                if prefix not in files:
                    files[prefix] = MmapedDict(os.path.join(path, f"{prefix}_{os.getpid()}.db"))
                self._file = files[prefix]
                self._key = mmap_key(metric_name, name, labelnames, labelvalues, help_text)
                self._value, _ts = self._file.read_value(self._key)

        def inc(self, amount: float) -> None:
            with lock:
                self._value += amount
                self._file.write_value(self._key, self._value, 0.0)

        def set(self, value: float, timestamp: float | None = None) -> None:
            with lock:
                self._value = value
                self._file.write_value(self._key, value, timestamp or 0.0)

        def get(self) -> float:
            with lock:
                return self._value

        def set_exemplar(self, exemplar: Any) -> None:
            pass  # multiprocess mode keeps no exemplars

        def get_exemplar(self) -> None:
            return None

    return FileValue
