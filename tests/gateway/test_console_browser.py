"""The console in a real browser: headless Chromium (Debian's package) driven by Playwright,
against `pagedserve serve` with two CPU workers and a tiny random model, API keys set.

The tests run in file order; the last one kills a worker. Where Chromium or playwright is
missing they skip (the `browser` marker, tests/conftest.py). PAGEDSERVE_SCREENSHOTS=DIR
keeps screenshots of the playground and the cluster view there (docs/ holds the ones the
README shows); by default they go to a temporary folder."""

from __future__ import annotations

import ast
import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import CHROMIUM

from pagedserve.common.redis_server import EmbeddedRedis

from serve_helpers import LiveServer
from tiny_models import build_checkpoint

pytestmark = pytest.mark.browser

KEY = "sk-test-a"  # serve_helpers.API_KEYS
PROMPT = "Tell me about the sea."
#: the markup a reply must show as text; a crafted stream carries it (see test_markup_in_output_is_text)
MARKUP = '<img src=x onerror="window.__pwned = 1"><b>bold</b><script>window.__pwned = 2</script>'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_checkpoint("llama", tmp_path_factory.mktemp("console-llama"), max_position_embeddings=4096)
    with EmbeddedRedis() as redis_server:
        live = LiveServer(model_dir, redis_server.url, "--num-workers", "2", "--heartbeat-interval", "0.5",
                          "--worker-timeout", "3", "--worker-restart-limit", "0", "--drain-timeout", "5",
                          "--attention-backend", "torch", "--enforce-eager")  # nothing to compile
        try:
            yield live.wait_ready()
        finally:
            live.stop()


def expect(target):
    from playwright.sync_api import expect as playwright_expect

    return playwright_expect(target)


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    where = os.environ.get("PAGEDSERVE_SCREENSHOTS")
    return Path(where) if where else tmp_path_factory.mktemp("screenshots")


class _Watched:
    """A page, with its console errors and every URL it requested."""

    def __init__(self, context, base_url: str):
        self.page = context.new_page()
        self.errors: list[str] = []
        self.urls: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.urls.append(r.url))
        self.page.goto(base_url + "/")


@pytest.fixture()
def watched(browser, server):
    """The console with the key already in the tab's session storage."""
    context = browser.new_context(viewport={"width": 1200, "height": 800})
    context.add_init_script(f"sessionStorage.setItem('pagedserve.apiKey', '{KEY}')")
    page = _Watched(context, server.base_url)
    expect(page.page.locator("#model-name")).not_to_have_text("")
    yield page
    context.close()


def _settings(page, temperature: str, max_tokens: str) -> None:
    page.fill("#temperature", temperature)
    page.fill("#max-tokens", max_tokens)


def _send(page, text: str) -> None:
    page.fill("#message", text)
    page.press("#message", "Enter")


def _last_reply(page, timeout_ms: int = 30_000):
    """The latest reply, once it ended (its finish reason is set). The page's CSP forbids
    eval, so waits are Playwright's locators, never wait_for_function."""
    reply = page.locator("#transcript li.assistant").last
    expect(reply).to_have_attribute("data-finish", re.compile(".*"), timeout=timeout_ms)
    return reply


def _cluster(server) -> dict:
    return httpx.get(server.base_url + "/v1/cluster", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()


def test_the_key_is_asked_for_and_kept_in_session_storage(browser, server):
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(server.base_url + "/")
        page.wait_for_selector("#key-panel:not([hidden])")
        page.fill("#key-input", KEY)
        page.press("#key-input", "Enter")
        expect(page.locator("#model-name")).not_to_have_text("")
        assert page.locator("#key-panel").is_hidden()
        assert page.evaluate("sessionStorage.getItem('pagedserve.apiKey')") == KEY
        assert page.evaluate("localStorage.length") == 0 and context.cookies() == []
    finally:
        context.close()


def test_a_streamed_reply_equals_the_api_greedy_answer(watched, server, shots):
    page = watched.page
    _settings(page, "0", "24")
    _send(page, PROMPT)
    reply = _last_reply(page)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    expected = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                              temperature=0, max_tokens=24)
    assert expected.choices[0].message.content  # a reply to compare, not two empty ones
    assert reply.locator(".content").text_content() == expected.choices[0].message.content
    assert reply.get_attribute("data-finish") == expected.choices[0].finish_reason
    stats = reply.locator(".stats").text_content()
    assert "TTFT" in stats and "cached prompt tokens" in stats and f"finish: {expected.choices[0].finish_reason}" in stats
    page.click("#copy-curl")
    assert "/v1/chat/completions" in page.locator("#snippet").text_content()
    page.screenshot(path=str(shots / "console-playground.png"))
    page.click("#copy-python")  # valid Python, asking exactly what the page asked
    snippet = page.locator("#snippet").text_content()
    call = next(n for n in ast.walk(ast.parse(snippet)) if isinstance(n, ast.Call) and ast.unparse(n.func) == "json.loads")
    assert json.loads(call.args[0].value) == {
        "model": model, "messages": [{"role": "user", "content": PROMPT}], "stream": True,
        "stream_options": {"include_usage": True}, "temperature": 0, "top_p": 1, "max_tokens": 24}
    page.click("#regenerate")  # the same request again: greedy, so the same reply, in place of the first
    again = _last_reply(page)
    assert again.locator(".content").text_content() == expected.choices[0].message.content
    assert page.locator("#transcript li.assistant").count() == 1


def test_stop_ends_the_stream_and_nothing_keeps_running(watched, server):
    page = watched.page
    _settings(page, "0", "3000")
    _send(page, PROMPT)
    expect(page.locator("#transcript li.assistant .content").last).not_to_have_text("", timeout=20_000)
    page.click("#stop-button")
    reply = _last_reply(page, timeout_ms=10_000)
    assert reply.get_attribute("data-finish") == "stopped"
    assert page.locator("#send").is_enabled()
    deadline = time.monotonic() + 15
    while True:  # the gateway cancels it; the workers' next heartbeats show none running
        status = _cluster(server)
        running = sum(w["num_running"] for w in status["workers"] if w["alive"])
        if running == 0 and status["queue"]["depth"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (running, status["queue"]["depth"]) == (0, 0)


def test_markup_in_output_is_text(watched):
    """A crafted stream (Playwright's page.route answers the chat request) carries markup."""
    page = watched.page
    chunks = [{"choices": [{"index": 0, "delta": {"content": MARKUP[:20]}, "finish_reason": None}]},
              {"choices": [{"index": 0, "delta": {"content": MARKUP[20:]}, "finish_reason": "stop"}]}]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=body))
    _send(page, "say markup")
    reply = _last_reply(page)
    assert reply.locator(".content").text_content() == MARKUP
    assert page.locator("#transcript img, #transcript b, #transcript script").count() == 0
    assert page.evaluate("window.__pwned") is None


def test_the_page_loads_with_no_error_and_no_other_origin(watched, server):
    page = watched.page
    page.click("#tab-cluster")
    expect(page.locator("#cluster-updated")).to_have_text(re.compile("^Updated"), timeout=10_000)
    expect(page.locator("#view-playground")).to_be_hidden()
    page.keyboard.press("ArrowLeft")  # back to the playground by keyboard
    expect(page.locator("#view-playground")).to_be_visible()
    expect(page.locator("#view-cluster")).to_be_hidden()
    assert watched.errors == []
    assert watched.urls and all(url.startswith(server.base_url + "/") for url in watched.urls)


#: (foreground, background) contrast of every visible text, as WCAG computes it; the
#: background is the first opaque one up the tree
CONTRAST = """() => {
  const rgb = (c) => (c.match(/[\\d.]+/g) || []).map(Number);
  const lum = ([r, g, b]) => [r, g, b].map((v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; })
    .reduce((sum, v, i) => sum + v * [0.2126, 0.7152, 0.0722][i], 0);
  const background = (el) => { for (; el; el = el.parentElement) { const c = rgb(getComputedStyle(el).backgroundColor);
    if (c.length === 3 || c[3] > 0) return c.slice(0, 3); } return [255, 255, 255]; };
  const worst = [];
  for (const el of document.querySelectorAll("body *")) {
    const own = [...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim());
    if (!own || !el.checkVisibility() || el.closest("button:disabled, svg")) continue;
    const a = lum(rgb(getComputedStyle(el).color)), b = lum(background(el));
    const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
    if (ratio < 4.5) worst.push(el.tagName + "#" + el.id + "." + el.className + " " + ratio.toFixed(2));
  }
  return worst;
}"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_text_contrast_reads_in_light_and_dark_mode(watched, scheme):
    page = watched.page
    page.emulate_media(color_scheme=scheme)
    _send(page, "Hi")
    _last_reply(page)
    page.click("#key-button")  # the key panel too
    assert page.evaluate(CONTRAST) == []
    page.click("#tab-cluster")
    expect(page.locator("#cluster-updated")).to_have_text(re.compile("^Updated"), timeout=10_000)
    assert page.evaluate(CONTRAST) == []
    # the check sees a faint text when there is one
    page.evaluate("() => { const p = document.createElement('p'); p.id = 'faint'; p.textContent = 'faint';"
                  " p.style.color = getComputedStyle(document.body).backgroundColor; document.body.append(p); }")
    assert [line.split(" ")[0] for line in page.evaluate(CONTRAST)] == ["P#faint."]


def test_the_cluster_view_counts_workers_and_sees_one_go(watched, server, shots):
    page = watched.page
    page.click("#tab-cluster")
    expect(page.locator("#workers-alive")).to_have_text("2", timeout=15_000)
    assert page.locator("#worker-rows tr[data-alive='true']").count() == 2
    expect(page.locator("#chart-tps polyline").first).to_be_attached(timeout=15_000)
    page.screenshot(path=str(shots / "console-cluster.png"), full_page=True)
    victim = server.workers()[0]
    os.kill(victim.pid, signal.SIGKILL)
    expect(page.locator("#workers-alive")).to_have_text("1", timeout=15_000)
    assert page.locator("#worker-rows tr[data-alive='true']").count() == 1
    assert page.locator(f"#worker-rows tr[data-worker-id='{victim.worker_id}']").get_attribute("data-alive") == "false"
    assert watched.errors == []
