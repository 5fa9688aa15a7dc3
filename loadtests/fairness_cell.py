"""Fair shares between tenants (batcher/fairness.py), measured side by side with the same
load on Ferry with `--fairness on` (the default) and `--fairness off`.

`two`: a noisy and a quiet tenant (`X-Ferry-Tenant`), equal weights, open-loop Poisson
arrivals of streaming chat requests (a short prompt, 32 new tokens, `ignore_eos`), each
carrying `--slo-ms` as its latency budget. Together they offer `--overload` x the capacity
(requests/s of 32 closed-loop clients, measured first on the same server), the noisy one
10x the quiet one's rate. Per tenant: offered/s, goodput (first token within the SLO)/s,
and the share of its offer served on time. The quiet tenant's demand is under its half
share, so with fairness it should be served in full. With `--vllm-python`, each round offers
the same rates (twice the capacity measured with fairness on) to vLLM on the same weights
as well: it has no tenants, so the quiet tenant's share there is what first come, first
served gives it.

`embeddings`: the same two tenants on the embeddings model (all-MiniLM-L6-v2), one
sentence a request with `--embed-slo-ms` as its budget, together `--overload` x the
capacity (requests/s of 32 closed-loop clients, measured first): a request is on time when
its answer comes within the budget.

`lengths`: two backlogged tenants of equal weight, one sending ~500-token prompts, the other
short ones: fair in weighted tokens, not in requests.

`weights`: four backlogged tenants with weights 1:1:2:4 (a config file names them), each
with `--clients` closed-loop clients asking `--answer-tokens` (64; `LO-HI`: each request
its own length in that range, drawn from its tenant, client and turn), `--max-running` fewer
than all their clients (fairness decides who takes the slots that free); over a
`--duration` window, each one's service in weighted tokens (`fair_input_weight` 1 x prompt
+ `fair_output_weight` 2 x generated, from `ferry_tenant_tokens_total`) against its
weighted share, and Jain's index on the service over the weights.

    python -m loadtests.fairness_cell --cells two,weights,lengths,embeddings --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import orjson

from tuner.traffic import sentence

from .goodput_cell import MAX_TOKENS, make_budget_send
from .openloop import GatewayProcess, Sample, open_loop
from .prefix_cell import vllm_server
from .saturation_cell import PROMPTS

MODEL = "ferry-tiny-chat"
EMBED_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
WEIGHTS = {"w1a": 1.0, "w1b": 1.0, "w2": 2.0, "w4": 4.0}


def closed_loop_rate(url: str, clients: int = 32, seconds: float = 10.0) -> float:
    """Requests/s that `clients` closed-loop clients get through (32 tokens each)."""

    async def main() -> int:
        done = 0
        until = time.perf_counter() + seconds
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:

            async def client(k: int) -> None:
                nonlocal done
                i = 0
                while time.perf_counter() < until:
                    body = {
                        "model": MODEL,
                        "messages": [{"role": "user", "content": PROMPTS[(k + i) % len(PROMPTS)]}],
                        "max_tokens": MAX_TOKENS,
                        "temperature": 0,
                        "ignore_eos": True,
                    }
                    i += 1
                    if (await http.post("/v1/chat/completions", json=body)).status_code == 200:
                        done += 1

            await asyncio.gather(*(client(k) for k in range(clients)))
        return done

    return asyncio.run(main()) / seconds


def closed_loop_embeddings(url: str, clients: int = 32, seconds: float = 8.0) -> float:
    """Requests/s (one sentence each) that `clients` closed-loop clients get through
    (aiohttp: short requests, the client's own CPU matters on two cores)."""

    async def main() -> int:
        done = 0
        until = time.perf_counter() + seconds
        async with aiohttp.ClientSession(base_url=url, connector=aiohttp.TCPConnector(limit=clients)) as session:

            async def client(k: int) -> None:
                nonlocal done
                i = k
                while time.perf_counter() < until:
                    body = orjson.dumps({"model": EMBED_MODEL, "input": sentence(i)})
                    async with session.post("/v1/embeddings", data=body, headers=JSON) as r:
                        await r.read()
                        done += r.status == 200
                    i += clients

            await asyncio.gather(*(client(k) for k in range(clients)))
        return done

    return asyncio.run(main()) / seconds


JSON = {"Content-Type": "application/json"}


def tenant_embed_send(slo_ms: float, tenant: str):
    """One sentence to embed with the SLO as its budget, as `tenant` (`X-Ferry-Tenant`)."""
    headers = {**JSON, "X-Ferry-Tenant": tenant}

    async def send(session, i: int) -> Sample:
        body = orjson.dumps({"model": EMBED_MODEL, "input": sentence(i), "latency_budget_ms": slo_ms})
        async with session.post("/v1/embeddings", data=body, headers=headers) as r:
            await r.read()
            return Sample(0.0, 0.0, r.status, tag=tenant)

    return send


def run_two(url: str, label: str, rate: float, duration: float, slo_ms: float, embeddings: bool = False) -> dict:
    """The noisy tenant at 10/11 of `rate`, the quiet one at 1/11, together; chat requests
    on time by their first token, embeddings by their answer."""
    noisy, quiet = rate * 10 / 11, rate / 11

    def sender(tenant: str):
        return tenant_embed_send(slo_ms, tenant) if embeddings else make_budget_send(MODEL, slo_ms, tenant)

    async def main() -> list[Sample]:
        a, b = await asyncio.gather(
            open_loop(noisy, duration, sender("noisy"), url, seed=1),
            open_loop(quiet, duration, sender("quiet"), url, seed=2),
        )
        return a + b

    def on_time(s: Sample) -> bool:
        done = s.latency if embeddings else s.ttft
        return s.status == 200 and done is not None and done * 1000 <= slo_ms

    samples = asyncio.run(main())
    row: dict = {"label": label}
    for tenant in ("noisy", "quiet"):
        mine = [s for s in samples if s.tag == tenant]
        good = [s for s in mine if on_time(s)]
        row[tenant] = {
            "offered": len(mine) / duration,
            "goodput": len(good) / duration,
            "on_time": len(good) / max(1, len(mine)),
            "refused": sum(s.status == 429 for s in mine),
            "late": sum(s.status == 200 for s in mine) - len(good),  # served past the budget: wasted work
        }
    n, q = row["noisy"], row["quiet"]
    print(
        f"  {label:22s} noisy {n['offered']:6.1f}/s offered, {n['goodput']:6.1f}/s on time, "
        f"{n['refused']} refused, {n['late']} late | quiet {q['offered']:5.1f}/s offered, {q['goodput']:5.1f}/s on "
        f"time ({q['on_time']:.0%}), {q['refused']} refused, {q['late']} late",
        flush=True,
    )
    return row


def tenant_tokens(url: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("ferry_tenant_tokens_total{"):
            labels = dict(part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(","))
            tenant, kind = labels["tenant"].strip('"'), labels["kind"].strip('"')
            out.setdefault(tenant, {"input": 0.0, "output": 0.0})[kind] += float(line.rsplit(" ", 1)[1])
    return out


def rows_held(url: str) -> float:
    """ferry_tenant_held_rows_total, every model's: rows fair shares held out of decode steps."""
    lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("ferry_tenant_held_rows_total{"))


LONG_PROMPT = " ".join(PROMPTS) * 12  # about 500 tokens of the tiny model


def run_weights(
    url: str,
    label: str,
    clients: int,
    duration: float,
    weights: dict[str, float] = WEIGHTS,
    long: str = "",
    answer_tokens: tuple[int, int] = (64, 64),
) -> dict:
    """Backlogged tenants: each one's weighted service over the window against its share
    (`long`: that tenant sends LONG_PROMPT, the others the short prompts)."""

    async def client(http: httpx.AsyncClient, tenant: str, k: int, until: float) -> None:
        i = 0
        while time.perf_counter() < until:
            prompt = LONG_PROMPT if tenant == long else PROMPTS[(k + i) % len(PROMPTS)]
            body = {
                "model": MODEL,
                # Unique from its first words: the prefix cache would make a repeated long prompt cheap.
                "messages": [{"role": "user", "content": f"({tenant} {k}.{i}) " + prompt}],
                "max_tokens": random.Random(f"{tenant} {k} {i}").randint(*answer_tokens),
                "temperature": 0,
                "ignore_eos": True,
                "latency_budget_ms": 600_000,
            }
            i += 1
            r = await http.post("/v1/chat/completions", json=body, headers={"X-Ferry-Tenant": tenant})
            if r.status_code == 200:
                requests[tenant] = requests.get(tenant, 0) + (lo <= time.perf_counter() <= hi)

    requests: dict[str, int] = {}
    lo = hi = 0.0
    held = [0.0, 0.0]  # ferry_tenant_held_rows_total at the window's start and end

    async def main() -> tuple[dict, dict]:
        nonlocal lo, hi
        limits = httpx.Limits(max_connections=clients * len(weights) + 4)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
            start = time.perf_counter()
            warm = duration / 3
            until = start + warm + duration
            lo, hi = start + warm, until
            # The tenants' clients interleaved: created tenant by tenant, the first one's requests
            # all arrived before the others' and took the empty server's slots, and its counter's
            # lead then kept it waiting through much of the window (one round in nine).
            tasks = [asyncio.create_task(client(http, t, k, until)) for k in range(clients) for t in weights]
            await asyncio.sleep(warm)
            before, held[0] = tenant_tokens(url), rows_held(url)
            await asyncio.sleep(duration)
            after, held[1] = tenant_tokens(url), rows_held(url)
            await asyncio.gather(*tasks, return_exceptions=True)
            return before, after

    before, after = asyncio.run(main())
    service = {}
    for t in weights:
        a, b = after.get(t, {"input": 0, "output": 0}), before.get(t, {"input": 0, "output": 0})
        service[t] = (a["input"] - b["input"]) + 2 * (a["output"] - b["output"])
    total, weight_sum = sum(service.values()), sum(weights.values())
    shares = {t: service[t] / total if total else 0.0 for t in weights}
    errors = {t: shares[t] / (weights[t] / weight_sum) - 1 for t in weights}
    x = [service[t] / weights[t] for t in weights]
    jain = sum(x) ** 2 / (len(x) * sum(v * v for v in x)) if any(x) else 0.0
    print(
        f"  {label:22s} shares "
        + ", ".join(f"{t} {shares[t]:.3f} ({errors[t]:+.1%}, {requests.get(t, 0)} req)" for t in weights)
        + f"  Jain {jain:.4f}  weighted tokens/s {total / duration:.0f}  rows held {held[1] - held[0]:.0f}",
        flush=True,
    )
    return {"label": label, "shares": shares, "errors": errors, "jain": jain, "tok_s": total / duration}


def config_file(chat_model: str = "tiny") -> str:
    """The weights cell's config: the tenants and their weights, and the chat model (served
    under the name the cells send, whatever it is)."""
    path = Path(tempfile.mkdtemp(prefix="ferry-fair-")) / "ferry.yaml"
    tenants = "".join(f"  - {{name: {t}, weight: {w}}}\n" for t, w in WEIGHTS.items())
    path.write_text(f"models:\n  - {{name: {MODEL}, kind: chat, source: {chat_model}}}\ntenants:\n{tenants}")
    return str(path)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cells", default="two,weights,lengths")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--slo-ms", type=float, default=500.0)
    p.add_argument("--embed-slo-ms", type=float, default=100.0, help="embeddings cell: each request's budget")
    p.add_argument(
        "--vllm-python",
        default=None,
        help="two cell: also offer each round's load to vLLM (this venv's python) on the same weights",
    )
    p.add_argument("--overload", type=float, default=2.0)
    p.add_argument(
        "--clients",
        type=int,
        default=16,
        help="weights and lengths cells: closed-loop clients per tenant (more than its share of the slots: backlogged)",
    )
    p.add_argument(
        "--answer-tokens",
        type=lambda v: tuple(int(x) for x in v.split("-")) if "-" in v else (int(v), int(v)),
        default=(64, 64),
        help="weights cell: tokens each answer (how long a request holds its slot); LO-HI: each its own in that range",
    )
    p.add_argument(
        "--holds-variant",
        action="store_true",
        help="weights cell: also fairness on with `--fair-hold-margin 0` (no rows held out of steps), beside",
    )
    p.add_argument(
        "--max-running",
        type=int,
        default=16,
        help="weights cell: sequences at once, fewer than the clients (tenants share the slots that free)",
    )
    p.add_argument(
        "--chat-model",
        default="tiny",
        help="the chat model, as `ferry serve --chat-model` takes it (`default`: SmolLM2-135M-Instruct)",
    )
    a = p.parse_args()
    if a.chat_model != "tiny":  # served under the name the cells send (GatewayProcess reads these)
        os.environ["FERRY_CHAT_MODEL"] = a.chat_model
        os.environ["FERRY_SERVED_MODEL_NAME"] = MODEL
    cells = set(a.cells.split(","))
    variants: tuple[tuple[str, tuple[str, ...]], ...] = (("fairness on", ()), ("fairness off", ("--fairness", "off")))
    if "two" in cells:
        print(f"Two tenants, noisy 10x quiet, {a.overload}x capacity, SLO {a.slo_ms:.0f} ms:")
        quiet: dict[str, list[float]] = {}
        for _ in range(a.repeats):
            rate = 0.0  # the load offered this round: twice the capacity measured with fairness on
            for label, flags in variants:
                with GatewayProcess("--embedding-model", "none", *flags) as gw:
                    cap = closed_loop_rate(gw.url)
                    rate = rate or a.overload * cap
                    row = run_two(gw.url, f"{label} (cap {cap:.0f}/s)", rate, a.duration, a.slo_ms)
                quiet.setdefault(label, []).append(row["quiet"]["on_time"])
            if a.vllm_python:
                from engine.tiny_chat import ensure_tiny_chat

                proc, url = vllm_server(a.vllm_python, ensure_tiny_chat())
                try:
                    row = run_two(url, "vLLM (no tenants)", rate, a.duration, a.slo_ms)
                finally:
                    proc.terminate()
                    proc.wait(60)
                quiet.setdefault("vLLM", []).append(row["quiet"]["on_time"])
        for label, shares in quiet.items():
            print(f"  median quiet on time, {label}: {statistics.median(shares):.1%}  ({shares})")
    if "embeddings" in cells:
        print(f"Two tenants on embeddings, noisy 10x quiet, {a.overload}x capacity, budget {a.embed_slo_ms:.0f} ms:")
        quiet = {}
        for _ in range(a.repeats):
            rate = 0.0
            for label, flags in variants:
                with GatewayProcess("--chat-model", "none", *flags) as gw:
                    cap = closed_loop_embeddings(gw.url)
                    rate = rate or a.overload * cap
                    row = run_two(gw.url, f"{label} (cap {cap:.0f}/s)", rate, a.duration, a.embed_slo_ms, True)
                quiet.setdefault(label, []).append(row["quiet"]["on_time"])
        for label, shares in quiet.items():
            print(f"  median quiet on time, {label}: {statistics.median(shares):.1%}  ({shares})")
    if "weights" in cells:
        print(f"Four backlogged tenants, weights 1:1:2:4, {a.clients} clients each:")
        rows: dict[str, list[dict]] = {}
        cfg = config_file(a.chat_model)
        # The config file names the models: no --chat-model beside it.
        saved = {k: os.environ.pop(k) for k in ("FERRY_CHAT_MODEL", "FERRY_SERVED_MODEL_NAME") if k in os.environ}
        weight_variants = variants + ((("no rows held", ("--fair-hold-margin", "0")),) if a.holds_variant else ())
        for _ in range(a.repeats):
            for label, flags in weight_variants:
                with GatewayProcess("--config", cfg, "--max-running", str(a.max_running), *flags) as gw:
                    rows.setdefault(label, []).append(
                        run_weights(gw.url, label, a.clients, a.duration, answer_tokens=a.answer_tokens)
                    )
        os.environ.update(saved)
        report(rows)
    if "lengths" in cells:
        print(
            f"Two backlogged tenants, equal weights, long (~500-token) against short prompts, {a.clients} clients each:"
        )
        rows = {}
        for _ in range(a.repeats):
            for label, flags in variants:
                with GatewayProcess("--max-running", str(a.max_running), "--embedding-model", "none", *flags) as gw:
                    run = run_weights(gw.url, label, a.clients, a.duration, {"long": 1.0, "short": 1.0}, long="long")
                    rows.setdefault(label, []).append(run)
        report(rows)


def report(rows: dict[str, list[dict]]) -> None:
    """Medians over the rounds: Jain's index, the worst tenant's share error, weighted tokens/s."""
    for label, rs in rows.items():
        worst = statistics.median(max(abs(e) for e in r["errors"].values()) for r in rs)
        print(
            f"  median, {label}: Jain {statistics.median(r['jain'] for r in rs):.4f}, worst share error "
            f"{worst:.1%}, weighted tokens/s {statistics.median(r['tok_s'] for r in rs):.0f}"
        )


if __name__ == "__main__":
    main()
