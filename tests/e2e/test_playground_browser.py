"""The web playground at `/`, driven in a real headless Chromium (Debian's package) with Playwright.

Screenshots at desktop and phone sizes are kept under $EDGELLM_TEST_ARTIFACTS (default build/test-artifacts).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)
if CHROMIUM is None:
    pytest.skip("no chromium executable (apt-get install chromium)", allow_module_level=True)

from edgellm.runtime.engine import Engine  # noqa: E402
from tests.serve.test_serve_api import MODEL, running_server, wait_ready  # noqa: E402

ARTIFACTS = Path(os.environ.get("EDGELLM_TEST_ARTIFACTS", "build/test-artifacts"))
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"],
          "additionalProperties": False}


def loader():
    return Engine.load(MODEL, threads=1, progress=False)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with running_server(loader, api_key="sesame") as base:
        wait_ready(base)
        yield base


def new_page(browser: Any, base: str, width: int, height: int) -> Any:
    # bypass_csp: the page's own CSP forbids eval, which Playwright's wait_for_function uses
    page = browser.new_context(viewport={"width": width, "height": height}, bypass_csp=True).new_page()
    failed: list[str] = []
    page.on("requestfailed", lambda r: failed.append(r.url))
    page.on("request", lambda r: failed.append(r.url) if not r.url.startswith(base) else None)
    page.failed = failed  # every request that left the server or failed
    return page


def enter_key(page: Any, base: str) -> None:
    page.goto(base + "/")
    page.fill("#apikey", "sesame")
    page.dispatch_event("#apikey", "change")


def open_page(browser: Any, base: str, width: int, height: int) -> Any:
    page = new_page(browser, base, width, height)
    enter_key(page, base)
    page.wait_for_selector("#status.ok", timeout=30_000)
    return page


def send(page: Any, text: str) -> Any:
    before = page.locator(".msg.assistant .figures").count()
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    page.wait_for_function(f"document.querySelectorAll('.msg.assistant .figures').length > {before} && "
                           "[...document.querySelectorAll('.msg.assistant .figures')].pop().textContent !== ''",
                           timeout=120_000)
    return page.locator(".msg.assistant").last


def test_page_is_self_contained_and_locked_down(server: str):
    import httpx

    response = httpx.get(server + "/")
    assert response.status_code == 200 and "<title>edgellm playground</title>" in response.text
    csp = response.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert "http://" not in response.text and "https://" not in response.text  # no CDN, nothing from elsewhere


def test_ready_only_once_the_models_defaults_are_in_the_fields(browser: Any, server: str):
    import httpx

    page = new_page(browser, server, 1280, 800)
    held: list[Any] = []
    hold = [True]
    page.route("**/api/show", lambda route: held.append(route) if hold[0] else route.continue_())
    enter_key(page, server)
    page.wait_for_function("document.getElementById('model').value !== ''", timeout=30_000)
    while not held:
        page.wait_for_timeout(50)
    page.wait_for_timeout(700)  # the health check has long answered: the page must still not claim "ready"
    assert page.get_attribute("#status", "class") != "ok", page.inner_text("#status")
    assert page.input_value("#max_tokens") == ""  # a value typed now would be overwritten or mixed with the default
    hold[0] = False
    for route in held:
        route.continue_()
    page.wait_for_selector("#status.ok", timeout=30_000)
    show = httpx.post(server + "/api/show", json={"model": page.input_value("#model")},
                      headers={"Authorization": "Bearer sesame"})
    assert page.input_value("#max_tokens") == str(show.json()["edgellm"]["sampling"]["max_tokens"])
    assert "ready" in page.inner_text("#status")


def test_chat_streams_a_reply_with_figures(browser: Any, server: str):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = open_page(browser, server, 1280, 800)
    seen: list[str] = []
    page.expose_function("recordText", lambda t: seen.append(t))
    page.evaluate("""() => new MutationObserver(() => {
        const b = [...document.querySelectorAll('.msg.assistant .body')].pop();
        if (b) window.recordText(b.textContent); }).observe(document.getElementById('log'),
        {subtree: true, childList: true, characterData: true})""")
    page.fill("#max_tokens", "24")
    reply = send(page, "What is the capital of France?")
    text = reply.locator(".body").inner_text()
    figures = reply.locator(".figures").inner_text()
    assert text.strip()
    assert "TTFT" in figures and "tok/s" in figures and "ran local" in figures, (figures, text)
    assert len({t for t in seen if t}) > 1, "the reply arrived in one piece, not streamed"
    assert "ready" in page.locator("#status").inner_text()
    page.click("text=Server")
    page.wait_for_function("document.getElementById('metrics').textContent.includes('edgellm_requests_total')")
    page.screenshot(path=str(ARTIFACTS / "playground-desktop.png"), full_page=True)
    assert page.failed == []


def test_json_mode_validates_the_result(browser: Any, server: str):
    page = open_page(browser, server, 1280, 800)
    page.click("text=JSON mode")
    page.check("#json")
    page.fill("#schema", json.dumps(SCHEMA, indent=2))
    page.fill("#max_tokens", "48")
    reply = send(page, "Name one city in France as JSON.")
    figures = reply.locator(".figures").inner_text()
    verdict = reply.locator(".valid, .invalid").inner_text()
    if "finish stop" in figures:  # a finished constrained reply always matches the schema
        assert verdict.startswith("✓"), verdict
        json.loads(reply.locator(".body").inner_text())
    else:
        assert "finish length" in figures and verdict.startswith("✗ not complete JSON")


def test_bad_schema_is_reported_without_a_request(browser: Any, server: str):
    page = open_page(browser, server, 1280, 800)
    page.click("text=JSON mode")
    page.check("#json")
    page.fill("#schema", "{not json")
    page.fill("#prompt", "hi")
    page.press("#prompt", "Enter")
    assert "schema is not valid JSON" in page.locator("#schema-error").inner_text()
    assert page.locator(".msg").count() == 0


def test_a_wrong_key_shows_the_servers_error(browser: Any, server: str):
    page = open_page(browser, server, 1280, 800)
    page.fill("#apikey", "wrong")
    page.fill("#prompt", "hi")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant .error", timeout=30_000)
    assert "Incorrect or missing API key" in page.locator(".msg.assistant .error").inner_text()


def test_phone_sized_screen(browser: Any, server: str):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page = open_page(browser, server, 390, 844)
    page.fill("#max_tokens", "12")
    send(page, "Say hello.")
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, f"the page scrolls sideways on a phone ({width}px wide)"
    box = page.locator("#prompt").bounding_box()
    assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 390
    page.screenshot(path=str(ARTIFACTS / "playground-phone.png"), full_page=True)
