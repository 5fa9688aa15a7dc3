"""The running set of generation: the sequences in the engine now, by id, and the ids the
engine must drop before its next step (cancelled, expired, stopped or failed ones).

Pure bookkeeping: who runs, what each has produced so far, and what leaves. Items are
resolved elsewhere (batcher/delivery.py, batcher/scheduler.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .types import GenResult, LogprobLedger, Priority, WorkItem


@dataclass(slots=True)
class _Seq:
    item: WorkItem
    limit: int = 1  # its max_tokens: where its slot frees at the latest
    pieces: list[str] = field(default_factory=list)
    tokens: int = 0
    last_token_at: float | None = None
    undelivered: int = 0  # tokens whose text is held back, counted in the next delta
    # A delta for every token, text or not: the engine makes no text for this sequence
    # (its params say detokenize=False), the caller decodes the ids (an engine core's front end).
    every_token: bool = False
    cached_tokens: int = 0  # of its prompt, tokens the engine's prefix cache served (its prefill's)
    logprobs: LogprobLedger = field(default_factory=LogprobLedger)  # where the request asked

    def result(self, finish_reason: str) -> GenResult:
        """What the item resolves with: the text and the token counts so far."""
        prompt = len(self.item.payload.prompt_ids)
        lp = self.logprobs
        return GenResult(
            "".join(self.pieces), finish_reason, prompt, self.tokens, self.cached_tokens, lp.tokens, lp.prompt
        )


class RunningSet:
    def __init__(self) -> None:
        self._seqs: dict[int, _Seq] = {}
        self._removals: list[int] = []
        self._batch_class = 0  # of the running sequences: admission reads it per request

    def __len__(self) -> int:
        return len(self._seqs)

    def values(self) -> list[_Seq]:
        return list(self._seqs.values())

    def prefilling(self) -> list[WorkItem]:
        """The items whose sequences have no token yet (their prompts still prefilling), in
        the order they joined."""
        return [s.item for s in self._seqs.values() if not s.tokens]

    def get(self, seq_id: int) -> _Seq | None:
        return self._seqs.get(seq_id)

    def join(self, items: list[WorkItem]) -> None:
        """Admitted items enter the running set (their prefill is this iteration's)."""
        for item in items:
            params = item.payload.params
            limit = max_tokens(item)
            self._seqs[item.id] = _Seq(item, limit, every_token=not getattr(params, "detokenize", True))
            self._batch_class += item.priority is Priority.BATCH

    def decoding(self, joining: set[int]) -> list[int]:
        """The ids a decode step runs: every running sequence but those joining now."""
        return [i for i in self._seqs if i not in joining]

    def drop(self, seq_id: int) -> _Seq | None:
        """Take a sequence out before it finished: the engine drops it before its next step.
        An id not running (finished already) is skipped: None."""
        seq = self._pop(seq_id)
        if seq is not None:
            self._removals.append(seq_id)
        return seq

    def leave(self, seq_id: int) -> _Seq | None:
        """Take out a sequence the engine no longer runs (finished, or its prefill failed)."""
        return self._pop(seq_id)

    def _pop(self, seq_id: int) -> _Seq | None:
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self._batch_class -= seq.item.priority is Priority.BATCH
        return seq

    @property
    def has_removals(self) -> bool:
        """Ids wait to be dropped from the engine (an iteration is due even with none running)."""
        return bool(self._removals)

    def take_removals(self) -> list[int]:
        removals, self._removals = self._removals, []
        return removals

    def has_batch_class(self) -> bool:
        return self._batch_class > 0


def max_tokens(item: WorkItem) -> int:
    """The most tokens `item` may generate (1 for a payload without sampling params)."""
    return int(getattr(item.payload.params, "max_tokens", 1) or 1)
