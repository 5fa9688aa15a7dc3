"""The live page's screenshot for the docs (docs/ui.png), as a user sees it: `ferry serve`
on its built-in models, steady load on both from a few threads (embeddings of a few
sentences, short chat completions, some interactive), one knob changed live half way (a
dashed mark on the charts), then a screenshot in headless Chromium.

    .venv/bin/python -m loadtests.ui_screenshot --out docs/ui.png

Needs Debian's `chromium` and `chromium-driver` (`make chromium`) and selenium (the test
extra). Not a benchmark: it only draws."""

from __future__ import annotations

import argparse
import itertools
import shutil
import threading
import time

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By

from .openloop import GatewayProcess

TOKEN = "ui-shot"
EMBED = "sentence-transformers/all-MiniLM-L6-v2"
CHAT = "ferry-tiny-chat"
SENTENCES = ["the ferry leaves at noon", "a short one", "batching trades latency for throughput, within budgets"]


def _client(url: str, stop: threading.Event, kind: str, pause: float) -> None:
    """One client sending `kind` requests until `stop`, `pause` seconds apart."""
    with httpx.Client(base_url=url, timeout=30) as c:
        for i in itertools.count():
            if stop.is_set():
                return
            if kind == "embed":
                c.post("/v1/embeddings", json={"model": EMBED, "input": SENTENCES[: 1 + i % 3]})
            else:
                interactive = i % 4 == 0
                c.post(
                    "/v1/chat/completions",
                    json={
                        "model": CHAT,
                        "messages": [{"role": "user", "content": f"tell me about ferries, {i}"}],
                        "max_tokens": 8 + i % 24,
                        "priority": "interactive" if interactive else "batch",
                        "latency_budget_ms": 500 if interactive else 5000,
                    },
                )
            stop.wait(pause)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/ui.png")
    ap.add_argument("--seconds", type=float, default=40.0, help="load before the screenshot")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=1500)
    args = ap.parse_args()
    with GatewayProcess("--admin-token", TOKEN) as gw:
        stop = threading.Event()
        clients = [("embed", 0.02)] * 3 + [("chat", 0.05)] * 3
        threads = [threading.Thread(target=_client, args=(gw.url, stop, k, p), daemon=True) for k, p in clients]
        for t in threads:
            t.start()
        options = Options()
        # Debian's browser and driver, named: selenium would otherwise look for them online.
        options.binary_location = shutil.which("chromium") or "chromium"
        for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
            options.add_argument(arg)
        options.add_argument(f"--window-size={args.width},{args.height}")
        driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
        try:
            driver.get(gw.url + "/ui")
            time.sleep(args.seconds / 2)
            # A live change, as an operator makes it from the page's form: a mark on the charts.
            httpx.patch(
                f"{gw.url}/admin/models/{EMBED}/batching",
                json={"max_wait_ms": 2},
                headers={"Authorization": f"Bearer {TOKEN}"},
            ).raise_for_status()
            time.sleep(args.seconds / 2)
            driver.execute_script("window.scrollTo(0, 0)")
            assert driver.find_elements(By.CSS_SELECTOR, "section.model"), "the page shows no model"
            driver.save_screenshot(args.out)
            print(f"saved {args.out}")
        finally:
            driver.quit()
            stop.set()
            for t in threads:
                t.join(30)


if __name__ == "__main__":
    main()
