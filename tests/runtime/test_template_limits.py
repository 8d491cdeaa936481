"""Chat template bombs (issue 29 finding 9): each way to build a huge string or number, or to loop for ever, is
refused before it is built with the typed TemplateLimitError in one line; ordinary templates still render; and a
server whose model ships a bomb template answers 400 and still stops on SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from edgellm.runtime import chat_template
from edgellm.runtime.chat_template import ChatTemplateError, TemplateLimitError, render_chat
from edgellm.serve.soak import wait_healthy

MESSAGES = [{"role": "user", "content": "hi"}]
BIG = "{% set s = 'a' * 1000000 %}"  # a million characters: within the per-operation caps, a bomb's seed

BOMBS = {
    "tilde": BIG + "{% set t = s ~ s ~ s ~ s ~ s ~ s ~ s ~ s %}{% set u = t ~ t ~ t ~ t ~ t ~ t ~ t ~ t %}"
                   "{{ (u ~ u)|length }}",
    "center": "{{ 'a'|center(500000000) }}",
    "ljust": "{{ 'a'.ljust(500000000) }}",
    "rjust": "{{ 'a'.rjust(500000000) }}",
    "zfill": "{{ '1'.zfill(500000000) }}",
    "replace_filter": BIG + "{{ s|replace('a', s)|length }}",
    "replace_method": BIG + "{{ s.replace('a', s)|length }}",
    "replace_empty": BIG + "{{ s|replace('', 'b' * 100)|length }}",
    "tojson_indent": "{% set l = [[[[1] * 100] * 100] * 100] %}{{ l|tojson(indent=100000)|length }}",
    "chained_power": "{{ ((2 ** 4096) ** 4096) ** 4096 }}",
    "int_product": "{% set n = 2 ** 4096 %}{{ n * n * n * n * n * n * n * n * n * n * n * n * n * n * n * n * n }}",
    "nested_range": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "string_multiplication": "{{ ('a' * 1000000) * 1000 }}",
    "list_join": "{% set l = ['a' * 1000000] * 1000000 %}{{ l|join|length }}",
    "percent_width": "{{ '%0999999999d' % 1 }}",
    "percent_refs": BIG + "{{ ('%(a)s' * 1000) % {'a': s} }}",
    "format_width": "{{ '{:>999999999}'.format(1) }}",
    "format_refs": BIG + "{{ ('{0}' * 1000).format(s)|length }}",
    "macro_buffer": BIG + "{% macro m() %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endmacro %}"
                          "{{ m()|length }}",
    "set_block": BIG + "{% set b %}{% for i in range(100000) %}{{ s }}{% endfor %}{% endset %}{{ b|length }}",
    "recursive_loop": "{% for x in range(100) recursive %}{{ loop(range(100)) }}{% endfor %}",
    "indent": "{% set s = '\\n' * 1000000 %}{{ s|indent(1000)|length }}",
    "batch_fill": "{{ [1]|batch(1000000000, 'x')|list|length }}",
    "expandtabs": "{{ ('\\t' * 1000000).expandtabs(100000)|length }}",
    "map_center": "{{ range(100000)|map('center', 100000)|join|length }}",
    "print_list": BIG + "{{ [s] * 1000 }}",
    "output": BIG + "{% for i in range(10) %}{{ s }}{% endfor %}",
}


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_each_bomb_is_refused_with_the_typed_error(name: str) -> None:
    with pytest.raises(TemplateLimitError, match="^chat template refused: ") as info:
        render_chat(BOMBS[name], MESSAGES)
    assert "\n" not in str(info.value)
    # refused by a limit checked before the work is done, not by running out of memory on the way
    assert re.search("over its limit of|recurses too deeply", str(info.value)), info.value


def test_the_step_budget_stops_loops_deterministically(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template, "MAX_STEPS", 1000)
    monkeypatch.setattr(chat_template, "MAX_RENDER_S", 3600.0)  # the step count, not the clock, stops it
    with pytest.raises(TemplateLimitError, match="over its limit of 1000 steps"):
        render_chat("{% for i in range(2000) %}{% endfor %}", MESSAGES)
    assert render_chat("{% for i in range(300) %}.{% endfor %}", MESSAGES) == "." * 300


def test_the_clock_stops_a_render_that_stays_within_its_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chat_template, "MAX_RENDER_S", 0.0)
    with pytest.raises(TemplateLimitError, match="over its limit of 0 s"):
        render_chat("{% for i in range(10) %}{% endfor %}", MESSAGES)


def test_work_within_the_limits_renders_as_python_computes_it() -> None:
    template = ("{{ 'ab'|center(9) }}|{{ 'x'.ljust(3) }}|{{ 'aXa'|replace('X', 'yy') }}|{{ 2 ** 100 }}|"
                "{{ '%05d' % 42 }}|{{ '{:>4}'.format('z') }}|{{ [1, [2]]|tojson(indent=1) }}|"
                "{% for i in range(3) %}{% for j in range(2) %}{{ i * j }}{% endfor %}{% endfor %}|"
                "{{ 'q' ~ 1 ~ none }}")
    expected = "|".join(["ab".center(9), "x".ljust(3), "ayya", str(2 ** 100), "%05d" % 42, "{:>4}".format("z"),
                         '[\n 1,\n [\n  2\n ]\n]', "000102", "q1None"])
    assert render_chat(template, MESSAGES) == expected


def test_a_template_error_is_still_a_chat_template_error() -> None:
    assert issubclass(TemplateLimitError, ChatTemplateError)


# ---- through `edgellm serve` -----------------------------------------------------------------------------------
def test_a_server_with_a_bomb_template_answers_400_and_stops_on_sigterm(tmp_path: Path) -> None:
    pytest.importorskip("fastapi")
    import httpx

    from edgellm.convert.pipeline import convert
    from tests.support.tiny_chat import _byte_tokenizer
    from tests.support.tiny import make_tiny

    make_tiny(tmp_path / "hf", "llama", tied=True)
    _byte_tokenizer(tmp_path / "hf")
    (tmp_path / "hf" / "chat_template.jinja").write_text(BOMBS["nested_range"] + "{{ messages[0].content }}",
                                                          encoding="utf-8")
    art = convert(tmp_path / "hf", tmp_path / "art", quantization="q0f32", progress=False)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    proc = subprocess.Popen([sys.executable, "-m", "edgellm.cli", "serve", str(art), "--port", str(port),
                             "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, 120, proc)
        r = httpx.post(base + "/v1/chat/completions", timeout=90,
                       json={"model": art.name, "messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert "chat template refused: over its limit of" in r.json()["error"]["message"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            pytest.fail("the server did not stop on SIGTERM")
    assert "Traceback" not in err
