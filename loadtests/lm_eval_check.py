"""lm-evaluation-harness against `ferry serve`, unchanged: the proof that evaluation
harnesses can use Ferry (never part of `make test`: lm-eval lives in a venv of its own).

Two tasks defined on loadtests/data/ferry_eval.jsonl (shipped; no hub): a multiple-choice
loglikelihood task (`output_type: multiple_choice`, which lm-eval scores through
`/v1/completions` with `echo`, `logprobs: 1`, `max_tokens: 1` and token-id prompts) and a
generation task (`generate_until`). lm-eval runs them through `local-completions`, and the
generation task through `local-chat-completions` too, with lm-eval's default settings: it finds
Ferry's `/tokenizer_info` and `/tokenize` and tokenizes through them. Then every loglikelihood lm-eval logged
is compared with the model's own, computed here in-process with one plain forward of the
same tokens: the largest difference must stay under 1e-4.

    python -m loadtests.lm_eval_check --lm-eval /tmp/lmeval-venv/bin/lm_eval

The lm-eval venv: `pip install "lm-eval[api]"` (the comparison in this process loads the
model with Ferry's own transformers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DATA = Path(__file__).parent / "data" / "ferry_eval.jsonl"
MODEL = "ferry-tiny-chat"

CHOICE_TASK = """task: ferry_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""

GENERATE_TASK = """task: ferry_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


def write_tasks(root: Path) -> Path:
    tasks = root / "tasks"
    tasks.mkdir()
    (tasks / "ferry_choice.yaml").write_text(CHOICE_TASK.format(data=DATA.resolve()))
    (tasks / "ferry_generate.yaml").write_text(GENERATE_TASK.format(data=DATA.resolve()))
    return tasks


def run_lm_eval(lm_eval: str, model: str, args: str, tasks: str, include: Path, out: Path, chat: bool) -> float:
    cmd = [
        lm_eval,
        "run",
        "--model",
        model,
        "--model_args",
        args,
        "--tasks",
        tasks,
        "--include_path",
        str(include),
        "--output_path",
        str(out),
        "--log_samples",
    ]
    if chat:
        cmd.append("--apply_chat_template")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "none"}
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-6000:])
        raise SystemExit(f"lm-eval failed ({model}, {tasks}): exit {done.returncode}")
    return time.perf_counter() - start


def logged(out: Path, task: str) -> list[dict]:
    files = sorted(out.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        raise SystemExit(f"lm-eval logged no samples for {task} under {out}")
    return [json.loads(line) for line in files[-1].read_text().splitlines() if line.strip()]


def own_loglikelihoods(model_dir: str, pairs: list[tuple[str, str]]) -> list[float]:
    """The model's own log P(continuation | context), tokenized as lm-eval tokenizes a pair
    (the whole string, the context's tokens cut off its front), one plain forward each."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for context, continuation in pairs:
        spaces = len(context) - len(context.rstrip())
        if spaces:  # lm-eval moves the context's trailing spaces onto the continuation
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = tokenizer.encode(context + continuation, add_special_tokens=False)
        ctx = tokenizer.encode(context, add_special_tokens=False)
        cont = whole[len(ctx) :]
        ids = torch.tensor([ctx + cont])
        with torch.inference_mode():
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        out.append(sum(float(logprobs[len(ctx) - 1 + i, t]) for i, t in enumerate(cont)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lm-eval", required=True, help="the lm_eval console script of a venv with lm-eval[api]")
    args = parser.parse_args()

    from engine.tiny_chat import ensure_tiny_chat

    from .openloop import GatewayProcess

    model_dir = ensure_tiny_chat()
    with tempfile.TemporaryDirectory(prefix="ferry-lm-eval-") as tmp:
        root = Path(os.environ.get("FERRY_LM_EVAL_DIR") or tmp)
        include = write_tasks(root)
        with GatewayProcess("--embedding-model", "none") as gw:
            # lm-eval's defaults: it finds the server's /tokenizer_info and /tokenize (vLLM's
            # routes) and tokenizes with them; no tokenizer files on this side.
            completions = f"model={MODEL},num_concurrent=4,max_retries=1,base_url={gw.url}/v1/completions"
            chat = f"model={MODEL},num_concurrent=4,max_retries=1,base_url={gw.url}/v1/chat/completions"
            tasks = "ferry_choice,ferry_generate"
            t_comp = run_lm_eval(args.lm_eval, "local-completions", completions, tasks, include, root / "comp", False)
            t_chat = run_lm_eval(
                args.lm_eval, "local-chat-completions", chat, "ferry_generate", include, root / "chat", True
            )
        choice = logged(root / "comp", "ferry_choice")
        pairs, served = [], []
        for sample in choice:
            for arguments, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
                pairs.append((arguments["arg_0"], arguments["arg_1"]))
                served.append(float(resp[0][0]))
        own = own_loglikelihoods(model_dir, pairs)
        worst = max(abs(a - b) for a, b in zip(served, own, strict=True))
        generated = logged(root / "comp", "ferry_generate")
        chatted = logged(root / "chat", "ferry_generate")
        print(
            f"local-completions: ferry_choice {len(choice)} docs ({len(pairs)} loglikelihoods), "
            f"ferry_generate {len(generated)} docs, {t_comp:.1f} s"
        )
        print(f"local-chat-completions: ferry_generate {len(chatted)} docs, {t_chat:.1f} s")
        print(f"loglikelihoods vs the model's own forward: largest difference {worst:.2e} (bar 1e-4)")
        if worst >= 1e-4:
            raise SystemExit("loglikelihoods differ from the model's own")


if __name__ == "__main__":
    main()
