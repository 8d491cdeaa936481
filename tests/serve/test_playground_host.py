"""The playground takes each model's own sampling defaults (from /api/show) instead of hard-coded ones, and renders
markdown and code in replies without letting a reply's HTML through; headless Chromium, tiny chat model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
CHROMIUM = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser")) if p), None)
if CHROMIUM is None:
    pytest.skip("no chromium executable (apt-get install chromium)", allow_module_level=True)

from tests.support.tiny_chat import tiny_chat_engine  # noqa: E402
from tests.serve.test_serve_api import running_server, wait_ready  # noqa: E402

NAME = "tiny-chat"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return tiny_chat_engine(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def base(tiny: Any) -> Iterator[str]:
    with running_server(lambda: tiny, NAME) as url:
        wait_ready(url)
        yield url


@pytest.fixture(scope="module")
def page(base: str) -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_context(bypass_csp=True).new_page()
            page.goto(base + "/")
            page.wait_for_function("document.getElementById('temperature').value !== ''", timeout=30_000)
            yield page
        finally:
            browser.close()


def test_the_models_own_defaults_fill_the_settings(page: Any, tiny: Any) -> None:
    sampling = tiny.config.sampling
    assert sampling.temperature != 0.2  # the old hard-coded value would show
    assert float(page.input_value("#temperature")) == sampling.temperature
    assert float(page.input_value("#top_p")) == sampling.top_p
    assert int(page.input_value("#max_tokens")) == sampling.max_tokens
    sent: list[dict[str, Any]] = []
    page.on("request", lambda r: sent.append(json.loads(r.post_data)) if r.url.endswith("/chat/completions")
            else None)
    page.fill("#max_tokens", "3")
    page.fill("#prompt", "t1")
    page.press("#prompt", "Enter")
    page.wait_for_function("[...document.querySelectorAll('.msg.assistant .figures')].pop().textContent !== ''",
                           timeout=60_000)
    assert sent[-1]["temperature"] == sampling.temperature and sent[-1]["max_tokens"] == 3
    page.fill("#temperature", "")  # emptied: not sent, so the server applies the model's default
    page.fill("#prompt", "t2")
    page.press("#prompt", "Enter")
    page.wait_for_function("document.querySelectorAll('.msg.assistant .figures').length === 2 && "
                           "[...document.querySelectorAll('.msg.assistant .figures')].pop().textContent !== ''",
                           timeout=60_000)
    assert "temperature" not in sent[-1]


@pytest.mark.parametrize("markdown, html", [
    ("a **bold** and *it* word", "a <strong>bold</strong> and <em>it</em> word"),
    ("use `x < y` here", "use <code>x &lt; y</code> here"),
    ("```python\nprint('<b>')\n```\ndone", "<pre><code>print(&#39;&lt;b&gt;&#39;)</code></pre>done"),
    ("## Title\ntext", "<strong>Title</strong>\ntext"),
    ("<img src=x onerror=alert(1)>", "&lt;img src=x onerror=alert(1)&gt;"),
    ('**"><script>x</script>**', "<strong>&quot;&gt;&lt;script&gt;x&lt;/script&gt;</strong>"),
    ("2 * 3 * 4", "2 * 3 * 4"),
])
def test_markdown_is_rendered_and_html_escaped(page: Any, markdown: str, html: str) -> None:
    assert page.evaluate("(text) => renderMarkdown(text)", markdown) == html


def test_a_reply_is_rendered_into_elements_not_markup(page: Any) -> None:
    """What renderMarkdown returns is the page's own tags only: a reply's <img> stays text."""
    count = page.evaluate("""() => { const d = document.createElement('div');
        d.innerHTML = renderMarkdown('<img src=x onerror=alert(1)> `<b>` **ok**');
        return [d.querySelectorAll('img, b').length, d.querySelectorAll('code, strong').length]; }""")
    assert count == [0, 2]
