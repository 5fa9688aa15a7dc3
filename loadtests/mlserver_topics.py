"""The example custom model (docs/examples/custom_model.py, TopicClassifier) as an MLServer
runtime, for loadtests/bench_custom.py: the same class, served by Seldon MLServer with its
adaptive batching. Runs in MLServer's own venv (never imported by Ferry or its tests):

    /tmp/mlserver-venv/bin/mlserver start <dir with settings.json and model-settings.json>

with `implementation: loadtests.mlserver_topics.TopicsRuntime` and the repository's root on
PYTHONPATH. MLServer merges the requests of a batch along the first dimension, calls
`predict` once and splits the outputs back, as Ferry's batcher does for its rows."""

from __future__ import annotations

import os

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec, StringCodec
from mlserver.types import InferenceRequest, InferenceResponse


class TopicsRuntime(MLModel):
    async def load(self) -> bool:
        import torch

        from docs.examples.custom_model import TopicClassifier

        # As many torch threads as Ferry's engine core gives the model (bench_custom --threads).
        torch.set_num_threads(int(os.environ.get("FERRY_BENCH_THREADS", "1")))
        self.classifier = TopicClassifier()
        self.classifier.load(device="cpu", dtype="float32")
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        texts = StringCodec.decode_input(payload.inputs[0])
        outputs = self.classifier.predict([{"text": t} for t in texts])
        rows = []
        for o in outputs:
            if isinstance(o, Exception):
                raise o  # MLServer fails the whole merged batch: it has no per-row errors
            rows.append(o)
        labels = [o["label"] for o in rows]
        scores = np.stack([np.asarray(o["scores"], dtype=np.float32) for o in rows])
        return InferenceResponse(
            model_name=self.name,
            outputs=[StringCodec.encode_output("label", labels), NumpyCodec.encode_output("scores", scores)],
        )
