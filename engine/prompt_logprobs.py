"""The log probability of every prompt token given the tokens before it (vLLM's
`prompt_logprobs`, what OpenAI's legacy completions return with `echo`): how evaluation
harnesses score a continuation (lm-evaluation-harness's loglikelihood tasks).

One forward over the whole prompt, apart from the prefill that generates (a cached prefix
has KV but no logits, and the prefill keeps only the last position's), run when the
sequence's first token is sampled: it is outside the step's token budget, and its logits
take prompt length x vocabulary floats. The values are the model's own distribution (no
temperature, penalties or bias: nothing was sampled), as vLLM's default reports them. The
first token has none (nothing precedes it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import TokenLogprob
from .forward import CausalForward
from .sampling import logprob_entries

# Positions whose log-softmax is taken at once: bounds the float32 copy (not the logits).
SLICE = 256


@torch.inference_mode()
def prompt_logprobs(forward: CausalForward, prompt: Sequence[int], top: int) -> list[TokenLogprob | None]:
    """[None, then for each later token (id, logprob, the `top` most likely ids with theirs)]."""
    ids = torch.tensor([list(prompt)], device=forward.device)
    logits = forward.all_logits(ids)[0]  # [len, vocab]; position i predicts token i + 1
    targets = list(prompt)[1:]
    out: list[TokenLogprob | None] = [None]
    for lo in range(0, len(targets), SLICE):
        chunk = targets[lo : lo + SLICE]
        lp = torch.log_softmax(logits[lo : lo + len(chunk)].float(), dim=-1)
        out.extend(logprob_entries(lp, chunk, [top] * len(chunk)))
    return out
