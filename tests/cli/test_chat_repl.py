"""`edgellm chat` under a pseudo-terminal: Ctrl-C stops a reply and keeps it, line editing, history, /save, /load."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from edgellm.chat_repl import load_conversation, save_conversation
from edgellm.errors import EdgeLLMError

pexpect = pytest.importorskip("pexpect")

MODEL = "smollm2-135m"
PROMPT = ">>> "


@pytest.fixture(scope="module", autouse=True)
def compiled_model() -> None:
    """Compile the model before the chat processes start, so the prompt's timeout measures the chat alone."""
    from edgellm.resolve import resolve_model

    resolve_model(MODEL, progress=False)


def _ctrl_c_interrupts() -> None:
    """In the chat process: Ctrl-C interrupts, even when this suite runs with SIGINT ignored (a non-interactive
    shell's background job: POSIX shells ignore SIGINT there, and children inherit it)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(*extra: str):
    child = pexpect.spawn(sys.executable, ["-m", "edgellm", "chat", MODEL, "-t", "1", "--temperature", "0", *extra],
                          env=dict(os.environ), encoding="utf-8", timeout=180, dimensions=(40, 200),
                          preexec_fn=_ctrl_c_interrupts)
    child.expect_exact(PROMPT)
    return child


def saved(child, path: Path) -> list[dict[str, str]]:
    child.sendline(f"/save {path}")
    child.expect(r"\(saved \d+ messages")
    child.expect_exact(PROMPT)
    return json.loads(path.read_text())["messages"]


def test_ctrl_c_stops_the_reply_keeps_it_and_chat_goes_on(tmp_path: Path):
    child = spawn("-n", "2000")
    child.sendline("Write a very long story about a dragon who learns to cook.")
    child.expect_exact("learns to cook.\r\n")  # the terminal's echo of the line
    child.expect(r"\w+ \w+ \w+")  # the reply is streaming
    child.sendintr()
    child.expect_exact("(stopped)")
    child.expect_exact(PROMPT)
    messages = saved(child, tmp_path / "chat.json")
    assert [m["role"] for m in messages] == ["user", "assistant"]
    assert messages[1]["content"].strip(), "the partial reply was not kept"
    child.sendline("/load " + str(tmp_path / "chat.json"))
    child.expect_exact("(loaded 2 messages")
    child.expect_exact(PROMPT)
    child.sendintr()  # Ctrl-C at an empty prompt leaves
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_line_editing_history_and_ctrl_d(tmp_path: Path):
    child = spawn("-n", "3")
    child.send("helo\x1b[Dl\r")  # type "helo", cursor left, insert "l" -> "hello"
    child.expect_exact(PROMPT)
    child.send("\x1b[A\r")  # up arrow: the previous line again
    child.expect_exact(PROMPT)
    messages = saved(child, tmp_path / "c.json")
    assert [m["content"] for m in messages if m["role"] == "user"] == ["hello", "hello"]
    child.send("typed but dropped")
    child.expect_exact("typed but dropped")  # readline echoed it: the line is in its buffer
    child.sendintr()  # Ctrl-C on a typed line drops the line, the chat stays
    child.expect_exact(PROMPT)
    child.sendline("/nope")
    child.expect_exact("unknown command /nope")
    child.sendline(f"/load {tmp_path / 'missing.json'}")
    child.expect_exact("does not exist")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_conversation_files_round_trip_and_bad_ones_are_named(tmp_path: Path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "你好"},
                {"role": "assistant", "content": "hi"}]
    path = tmp_path / "conv.json"
    save_conversation(path, "m", messages)
    assert load_conversation(path) == messages
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left
    for content, error in [("{", "not JSON"), ("[]", 'no "messages" list'),
                           ('{"messages": [{"role": "robot", "content": "x"}]}', "message 1 needs a role"),
                           ('{"messages": [{"role": "user", "content": 3}]}', "message 1 needs a role")]:
        path.write_text(content)
        with pytest.raises(EdgeLLMError, match=error):
            load_conversation(path)
    with pytest.raises(EdgeLLMError, match="cannot save to"):
        save_conversation(tmp_path / "no" / "such" / "dir.json", "m", messages)
