"""The live page (GET /ui) in a real headless Chromium driven by selenium, against a real
gateway over fake engines under light load from a background thread.

It checks what a person at the page would see: no console errors, charts that gain points,
a knob change with the admin token that reaches the gateway (its admin GET shows it) and is
marked on the charts, the 401 message for a wrong token, a read-only form without one, and
a model name made of HTML shown as text. (docs/ui.png is made by loadtests/ui_screenshot.py,
on the built-in models.)

Needs Debian's `chromium` and `chromium-driver` (`make chromium`, as root) and selenium
(the test extra); skipped with the reason when one is missing.
"""

from __future__ import annotations

import shutil
import threading

import httpx
import pytest

from engine.fake import FakeEmbeddingEngine

from ..conftest import fake_app
from ..live import live
from ..waiting import wait_until

try:
    from selenium import webdriver
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
except ImportError:  # pragma: no cover - the test extra installs it
    webdriver = None

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
HTML_NAME = "<img src=x onerror=alert(1)>"
TOKEN = "admin-secret"
API_KEY = "k-live"

pytestmark = pytest.mark.skipif(
    webdriver is None or CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs selenium (the test extra) and Debian's chromium + chromium-driver (as root: `make chromium`)",
)


def _load(url: str, stop: threading.Event) -> None:
    """Light steady load on both models until `stop`."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
        while not stop.is_set():
            c.post("/v1/embeddings", json={"model": HTML_NAME, "input": ["one", "two", "three"]})
            c.post(
                "/v1/chat/completions",
                json={"model": "fake-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
            )
            stop.wait(0.01)


@pytest.fixture
def browser():
    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1500")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def _severe(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def test_live_page_in_a_real_browser(browser):
    app = fake_app(embed=FakeEmbeddingEngine(name=HTML_NAME), admin_token=TOKEN, api_keys=[API_KEY])
    with live(app) as server:
        stop = threading.Event()
        load = threading.Thread(target=_load, args=(server.url, stop), daemon=True)
        load.start()
        try:
            _check_page(browser, server)
        finally:
            stop.set()
            load.join(30)


def _section(driver, name: str):
    for s in driver.find_elements(By.CSS_SELECTOR, "section.model"):
        if s.get_attribute("data-model") == name:
            return s
    return None


def _retype(field, text: str) -> None:
    """Replace a field's text as a person does (key events, so the page hears `input`)."""
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(Keys.BACKSPACE)
    if text:
        field.send_keys(text)


def _points(section) -> list[int]:
    return [int(c.get_attribute("data-points")) for c in section.find_elements(By.CSS_SELECTOR, ".chart")]


def _check_page(d, server) -> None:
    # /ui is open under --api-key, as /metrics is; the page needs no key.
    d.get(server.url + "/ui")
    wait_until(lambda: _section(d, "fake-chat") and _section(d, HTML_NAME), message="both models on the page")
    chat, embed = _section(d, "fake-chat"), _section(d, HTML_NAME)

    # A model name made of HTML is shown as text: no <img> was made, no alert ran.
    assert embed.find_element(By.CSS_SELECTOR, ".model-name").text == HTML_NAME
    assert d.find_elements(By.TAG_NAME, "img") == []

    # The charts gain points, second after second.
    before = _points(chat)
    wait_until(lambda: all(a > b for a, b in zip(_points(chat), before, strict=True)), message="new points")
    wait_until(lambda: int(embed.find_element(By.CSS_SELECTOR, "[data-chart=cost]").get_attribute("data-points")) > 0,
               message="observed batches on the embeddings cost chart")  # fmt: skip
    assert _severe(d) == []

    # The chat model's prefix cache hit rate (the load repeats one prompt); none for embeddings.
    def prefix_cache(section) -> list[str]:
        # The page redraws its panels every second: one redrawn between finding a cell and
        # reading it is read again on the next try.
        try:
            panels = section.find_elements(By.CSS_SELECTOR, ".panel")
            found = [p for p in panels if p.find_element(By.TAG_NAME, "h3").text.startswith("Prefix cache")]
            return [td.text for p in found for td in p.find_elements(By.CSS_SELECTOR, "td.num")][:1]
        except StaleElementReferenceException:
            return []

    wait_until(lambda: prefix_cache(chat) and prefix_cache(chat)[0].endswith("%"), message="the hit rate shown")
    assert prefix_cache(embed) == []
    kv_panel = [p for p in chat.find_elements(By.CSS_SELECTOR, ".panel") if "KV in use" in p.text]
    assert kv_panel and "preemptions" in kv_panel[0].text  # the KV budget's use and the window's preemptions

    # No token: the knobs are read-only.
    size = chat.find_element(By.CSS_SELECTOR, "input[name=max_batch_size]")
    apply = chat.find_element(By.CSS_SELECTOR, "button.apply")
    assert not size.is_enabled() and not apply.is_enabled()
    assert "read-only" in d.find_element(By.ID, "token-note").text

    # The right token: a change reaches the gateway and is marked on the charts.
    d.find_element(By.ID, "token").send_keys(TOKEN)
    wait_until(size.is_enabled, message="the knobs to become editable with a token")
    old = server.ferry.models["fake-chat"].batcher.settings.max_batch_size
    new = max(old // 4, 1)
    _retype(size, str(new))
    apply.click()
    message = chat.find_element(By.CSS_SELECTOR, ".message")
    wait_until(lambda: "applied" in message.text, message=lambda: f"'applied', not {message.text!r}")
    admin = httpx.get(server.url + "/admin/models/fake-chat/batching", headers={"Authorization": f"Bearer {TOKEN}"})
    assert admin.json()["max_batch_size"] == new
    wait_until(lambda: chat.find_elements(By.CSS_SELECTOR, "li.mark"), message="the change in the list of marks")
    assert f"max_batch_size {old} → {new}" in chat.find_element(By.CSS_SELECTOR, "li.mark").text
    time_charts = chat.find_elements(By.CSS_SELECTOR, ".chart[data-marks]")
    assert len(time_charts) == 3 and all(c.get_attribute("data-marks") == "1" for c in time_charts)
    assert _severe(d) == []

    # A wrong token: the 401 message, and nothing changes.
    token = d.find_element(By.ID, "token")
    _retype(token, "wrong-token")
    _retype(size, str(old))
    apply.click()
    wait_until(lambda: "401" in message.text, message=lambda: f"the 401 message, not {message.text!r}")
    assert "invalid admin token" in message.text
    assert server.ferry.models["fake-chat"].batcher.settings.max_batch_size == new
    # The one console error is the browser's note of that 401.
    assert all("401" in e["message"] for e in _severe(d))

    # Token cleared: read-only again.
    _retype(token, "")
    wait_until(lambda: not size.is_enabled(), message="the knobs to become read-only again")
