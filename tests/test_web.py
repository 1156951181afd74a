"""The web page at `/`, driven by a headless Chromium (Debian's /usr/bin/chromium via Playwright):
send a prompt, watch draft frames arrive, check the final text equals the API's for the same seed,
and save a screenshot to artifacts/web.png."""

from __future__ import annotations

import contextlib

from pathlib import Path

import pytest

pytest.importorskip("playwright.sync_api")
pytest.importorskip("openai")
CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip("needs Debian's chromium (apt-get install -y chromium)", allow_module_level=True)

import httpx  # noqa: E402
from playwright.sync_api import sync_playwright  # noqa: E402

from test_server import ServerProcess, build_tiny_model  # noqa: E402

ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(build_tiny_model(tmp_path_factory.mktemp("tiny_web")), "--max-tokens-limit", "256")
    yield s
    s.stop()


@contextlib.contextmanager
def open_page(server):
    """Chromium on the server's page, once it knows the model; yields (page, page errors)."""
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 800})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)  # e.g. a 404
            page.goto(server.url + "/")
            page.wait_for_function("document.getElementById('model').dataset.id !== undefined")
            yield page, errors
        finally:
            browser.close()


def test_page_streams_drafts_and_final_text(server):
    # a seed past 2**53: the page sent it as a JS number, another seed (2**63 here, whose draws differ from 11's)
    steps, max_tokens, seed = 6, 40, 2**63 + 11
    with open_page(server) as (page, errors):
        page.eval_on_selector("#steps", f"e => {{ e.value = {steps}; e.dispatchEvent(new Event('input')); }}")
        assert page.text_content("#steps-out") == str(steps)
        page.fill("#max-tokens", str(max_tokens))
        page.fill("#seed", str(seed))
        page.fill("#prompt", "Why is the sky blue?")
        page.click("#send")
        page.wait_for_selector(".msg.assistant[data-done='1']", timeout=60_000)

        text = page.text_content(".msg.assistant .content")
        frames = int(page.get_attribute("#canvas", "data-frames"))
        assert frames == 3 * steps  # 40 tokens = 3 canvases of 16, one frame per denoising step
        assert page.locator("#canvas span").count() == 16
        # every step accepts at least the lowest-entropy position, drawn highlighted
        assert int(page.get_attribute("#canvas", "data-accepted")) >= frames
        assert page.locator("#canvas span.stable").count() == 16  # the committed canvas
        assert page.text_content("#canvas-head") == f"· canvas 3 · step {steps}/{steps}"
        assert page.text_content("dd[data-stat='tokens']") == str(max_tokens)
        assert float(page.text_content("dd[data-stat='steps/canvas']")) == steps
        assert not errors, errors

        api = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": max_tokens,
            "seed": seed, "steps": steps, "chat_template_kwargs": {"enable_thinking": False}}).json()
        assert text and text == api["choices"][0]["message"]["content"]

        # a second, slower turn: screenshot mid-canvas (noise turning into text), then hang up
        page.eval_on_selector("#steps", "e => { e.value = 48; e.dispatchEvent(new Event('input')); }")
        page.fill("#max-tokens", "256")
        page.fill("#prompt", "And why is the sea blue?")
        page.click("#send")
        # noise on the canvas while it denoises, checked in the page itself (with the fast kernels a turn can end
        # within the time a screenshot takes, so a count after the screenshot would race the stream)
        page.wait_for_function("Number(document.getElementById('canvas').dataset.frames) >= 20 && "
                               "document.querySelectorAll('#canvas span.noise').length > 0")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "web.png"), full_page=True)
    assert (ARTIFACTS / "web.png").stat().st_size > 10_000


def test_page_text_mode_fills_the_gap_between_two_texts(server):
    """Text mode posts /v1/completions; with text in the second box it is insert mode (OpenAI's `suffix`):
    the page shows prompt + fill + suffix, and the fill equals the API's for the same seed."""
    steps, max_tokens, seed = 4, 6, 3
    prompt, suffix = "Once upon a", " lived a king."
    with open_page(server) as (page, errors):
        assert page.input_value("#mode") == "chat"  # the tiny model has a chat template
        assert page.is_hidden("#suffix")
        page.select_option("#mode", "text")
        assert page.is_visible("#suffix") and page.is_hidden("#thinking")
        page.eval_on_selector("#steps", f"e => {{ e.value = {steps}; e.dispatchEvent(new Event('input')); }}")
        page.fill("#max-tokens", str(max_tokens))
        page.fill("#seed", str(seed))
        page.fill("#prompt", prompt)
        page.fill("#suffix", suffix)
        page.click("#send")
        page.wait_for_selector(".msg.completion[data-done='1']", timeout=60_000)
        fill = page.text_content(".msg.completion .fill")
        assert page.text_content(".msg.completion") == prompt + fill + suffix
        assert int(page.get_attribute("#canvas", "data-frames")) == steps  # one canvas: hole + suffix fit
        assert not errors, errors
        api = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "suffix": suffix, "max_tokens": max_tokens, "seed": seed, "steps": steps}).json()
        assert fill == api["choices"][0]["text"]
        assert page.input_value("#prompt") == prompt  # text mode keeps the boxes for another run


def test_page_new_chat_aborts_the_reply_and_text_mode_errors_stay_out_of_the_text(server):
    """"new chat" while a reply streamed left the fetch running, and its reply landed in the cleared conversation
    (the next request began with an orphan assistant turn): now it aborts the reply. An error in text mode was
    written into the highlighted fill, reading as the model's text; now it goes below the text."""
    with open_page(server) as (page, errors):
        page.eval_on_selector("#steps", "e => { e.value = 64; e.dispatchEvent(new Event('input')); }")
        page.fill("#max-tokens", "200")
        page.fill("#prompt", "Tell me a long story.")
        page.click("#send")
        page.wait_for_function("Number(document.getElementById('canvas').dataset.frames) > 0", timeout=60_000)
        page.click("#reset")
        page.wait_for_function("!document.getElementById('send').disabled", timeout=30_000)
        page.wait_for_timeout(300)
        assert page.eval_on_selector("#log", "e => e.children.length") == 0
        page.select_option("#mode", "text")
        page.fill("#max-tokens", "1000")  # over the server's --max-tokens-limit 256: a 400
        page.fill("#prompt", "Once upon a")
        page.click("#send")
        page.wait_for_selector(".msg.completion.error", timeout=30_000)
        assert page.text_content(".msg.completion .fill") == ""
        assert "error: max_tokens=1000 exceeds" in page.text_content(".msg.completion .tool")
        assert errors == ["Failed to load resource: the server responded with a status of 400 (Bad Request)"]


def test_page_without_a_model_chats_with_the_shipped_assistant(tmp_path):
    """`blockpress serve` with no model: the page opens in chat mode on the shipped chat model, and a thinking turn
    shows the thought channel apart from the answer, both as the API gives them for the same seed. The screenshot
    is README's (docs/web-chat-mode.png is copied from artifacts/web-chat.png)."""
    from blockpress.loading import SHIPPED_MODELS

    s = ServerProcess(SHIPPED_MODELS["assistant"], log=tmp_path / "serve.log")
    try:
        with open_page(s) as (page, errors):
            assert page.input_value("#mode") == "chat"
            page.check("#thinking")
            page.fill("#seed", "0")
            page.fill("#prompt", "Convert 3 km to m.")
            page.click("#send")
            page.wait_for_selector(".msg.assistant[data-done='1']", timeout=60_000)
            thought = page.text_content(".msg.assistant .reasoning")
            answer = page.text_content(".msg.assistant .content")
            assert not errors, errors
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "web-chat.png"), full_page=True)
        api = httpx.post(s.url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "Convert 3 km to m."}], "seed": 0,
            "chat_template_kwargs": {"enable_thinking": True}}).json()["choices"][0]["message"]
        assert thought.strip() and (thought, answer) == (api["reasoning_content"], api["content"])
    finally:
        s.stop()


def test_page_stop_keeps_the_reply_so_far_and_frees_the_row(server):
    """The page had no stop: "new chat" was the only way out, and it threw the whole conversation away. "stop" ends
    the reply where it is (the server frees its row when the stream closes), keeps what it wrote on screen and in
    the conversation the next turn sends."""
    with open_page(server) as (page, errors):
        assert page.is_hidden("#stop")
        page.eval_on_selector("#steps", "e => { e.value = 64; e.dispatchEvent(new Event('input')); }")
        page.fill("#max-tokens", "200")
        page.fill("#prompt", "Tell me a long story.")
        page.click("#send")
        page.wait_for_function("Number(document.getElementById('canvas').dataset.frames) > 2", timeout=60_000)
        assert page.is_visible("#stop")
        page.click("#stop")
        page.wait_for_selector(".msg.assistant.stopped[data-done='1']", timeout=30_000)
        assert page.is_hidden("#stop") and "(stopped)" in page.text_content(".msg.assistant .tool")
        for _ in range(50):
            if httpx.get(server.url + "/health").json()["active"] == 0:
                break
            page.wait_for_timeout(100)
        assert httpx.get(server.url + "/health").json()["active"] == 0
        sent = []
        page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/chat/completions") else None)
        page.eval_on_selector("#steps", "e => { e.value = 2; e.dispatchEvent(new Event('input')); }")
        page.fill("#max-tokens", "8")
        page.fill("#prompt", "Go on.")
        page.click("#send")
        page.wait_for_selector(".msg.assistant:nth-of-type(4)[data-done='1']", timeout=60_000)
        assert [m["role"] for m in sent[0]["messages"]] == ["user", "assistant", "user"]
        assert not errors, errors


def test_page_reports_a_stream_cut_before_done(server):
    """A stream that ended without `data: [DONE]` (a server or proxy gone mid-reply) was taken for a whole reply and
    added to the conversation; now the reply says so and the question is marked as not sent again. Events may end
    their lines with CRLF (the page ignored such a stream)."""
    chunk = ('data: {"id":"x","object":"chat.completion.chunk","created":0,"model":"m","choices":[{"index":0,'
             '"delta":{"content":"Half a"},"finish_reason":null}]}\r\n\r\n')
    with open_page(server) as (page, errors):
        page.route("**/v1/chat/completions", lambda route: route.fulfill(
            status=200, headers={"Content-Type": "text/event-stream"}, body=chunk))
        page.fill("#prompt", "Hello?")
        page.click("#send")
        page.wait_for_selector(".msg.assistant.error", timeout=30_000)
        assert "the stream ended before the reply did" in page.text_content(".msg.assistant .content")
        assert "unsent" in page.get_attribute(".msg.user", "class")
        page.unroute("**/v1/chat/completions")
        page.route("**/v1/chat/completions", lambda route: route.fulfill(
            status=200, headers={"Content-Type": "text/event-stream"}, body=chunk + "data: [DONE]\r\n\r\n"))
        page.fill("#prompt", "Hello again?")
        page.click("#send")
        page.wait_for_selector(".msg.assistant[data-done='1']", timeout=30_000)
        assert page.text_content(".msg.assistant[data-done='1'] .content") == "Half a"
        assert not errors, errors


def test_page_with_an_api_key_learns_the_model_once_the_key_is_given(tmp_path):
    """With `serve --api-key`, the page's first /v1/models got a 401 it swallowed: the label stayed "…" and a plain
    text model stayed in chat mode until a reload. Now the 401 is shown, and entering the key asks again."""
    from blockpress.loading import SHIPPED_MODELS

    s = ServerProcess(SHIPPED_MODELS["kjv"], "--api-key", "sekret", log=tmp_path / "serve.log")
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
            try:
                page = browser.new_page()
                page.goto(s.url + "/")
                page.wait_for_function("document.getElementById('model').textContent.includes('401')")
                page.fill("#apikey", "sekret")
                page.dispatch_event("#apikey", "change")
                page.wait_for_function("document.getElementById('model').dataset.id !== undefined")
                assert page.input_value("#mode") == "text"  # kjv has no chat template
            finally:
                browser.close()
    finally:
        s.stop()
