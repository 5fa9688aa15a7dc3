"""Request translation: a validated request body becomes work for a batcher, and the
results of that work become the response body. The HTTP routes and the batch-job worker
both go through here, so a batch line and a direct request are checked, queued and
answered alike.

- `work`: what a translated request is (`Work`: payloads, costs, `response(results)`).
- `chat`: chat and completions (prompts through the chat template, per-prompt sampling
  parameters, stop strings, token limits; response bodies); `stream`: their stream chunks.
- `reasoning`: thinking per prompt (template arguments; reasoning split from the answer).
- `logprobs`: log probabilities in OpenAI's chat and legacy completions shapes.
- `structured`: response formats and tool calls per prompt, and the constrained answers
  read back as OpenAI shapes.
- `per_prompt`: a field given once for every prompt or as a per-prompt list, spread over
  the prompts.
- `embeddings`: embedding inputs (tokenization, limits, response body).

Nothing here knows about HTTP: no requests, no headers, no SSE framing.
"""
