"""`edgellm chat`: the interactive loop — line editing, Ctrl-C to stop a reply, /save and /load.

Ctrl-C while a reply streams stops that reply and keeps what was written in the conversation; Ctrl-C at an
empty prompt, Ctrl-D, or /exit leave. Line history lives in memory only: prompts are never written to disk
unless the user asks with /save.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TextIO

from edgellm.errors import EdgeLLMError

if TYPE_CHECKING:
    from types import FrameType

    from edgellm.generation import GenerationParams, GenerationStats
    from edgellm.runtime.chat_session import ChatSession

COMMANDS = "/stats, /reset, /save FILE, /load FILE, /help, /exit"
ROLES = ("system", "user", "assistant")

try:  # line editing and in-session history where the platform has readline
    import readline
except ImportError:  # pragma: no cover - Windows without pyreadline
    readline = None  # type: ignore[assignment]


def save_conversation(path: Path, model: str, messages: list[dict[str, str]]) -> None:
    """Write the conversation as JSON, atomically (a failed write leaves any older file as it was)."""
    payload = json.dumps({"model": model, "messages": messages}, ensure_ascii=False, indent=2)
    path = path.expanduser()
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise EdgeLLMError(f"cannot save to {path}: {exc.strerror}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(payload + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise EdgeLLMError(f"cannot save to {path}: {exc.strerror}") from None


def load_conversation(path: Path) -> list[dict[str, str]]:
    """The messages of a conversation saved with /save; EdgeLLMError names what is wrong."""
    path = path.expanduser()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise EdgeLLMError(f"{path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise EdgeLLMError(f"cannot read {path}: {exc}") from None
    except ValueError as exc:
        raise EdgeLLMError(f"{path} is not a saved conversation (not JSON: {exc})") from None
    messages = raw.get("messages") if isinstance(raw, dict) else None
    if not isinstance(messages, list):
        raise EdgeLLMError(f"{path} is not a saved conversation (no \"messages\" list)")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise EdgeLLMError(f"{path}: message {i + 1} needs a role ({', '.join(ROLES)}) and string content")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class ChatRepl:
    """One interactive conversation, kept inside the model's window by a ChatSession; `run()` returns the
    exit code."""

    def __init__(self, session: ChatSession, params: GenerationParams,
                 print_stats: Callable[[GenerationStats], None], *, out: TextIO = sys.stdout,
                 err: TextIO = sys.stderr) -> None:
        self.session = session
        self.engine = session.engine
        self.params = params
        self.print_stats = print_stats
        self.out = out
        self.err = err
        self.typed_at_interrupt = ""

    def say(self, text: str) -> None:
        print(text, file=self.err, flush=True)

    def run(self) -> int:
        self.say(f"chatting with {self.engine.name} (memory estimate {self.engine.memory.describe()}). "
                 f"Commands: {COMMANDS}. Ctrl-C stops a reply; Ctrl-D exits.")
        while True:
            try:
                line = self.read_line()
            except EOFError:
                print(file=self.out)
                return 0
            except KeyboardInterrupt:
                print(file=self.out)
                if self.typed_at_interrupt.strip():
                    continue  # Ctrl-C on a typed line drops the line, as a shell does
                return 0
            text = line.strip()
            if not text:
                continue
            if text.startswith("/"):
                if self.command(text):
                    return 0
                continue
            self.reply(line)

    def read_line(self) -> str:
        """One input line; on Ctrl-C, `typed_at_interrupt` holds what was on the line (readline clears it)."""
        self.typed_at_interrupt = ""

        def on_interrupt(signum: int, frame: FrameType | None) -> None:
            self.typed_at_interrupt = readline.get_line_buffer() if readline is not None else ""
            raise KeyboardInterrupt

        previous = signal.signal(signal.SIGINT, on_interrupt)
        try:
            return input(">>> ")
        finally:
            signal.signal(signal.SIGINT, previous)

    def command(self, text: str) -> bool:
        """Run a /command; True when the chat should end."""
        name, _, arg = text.partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit", "/bye"):
            return True
        try:
            if name == "/reset":
                self.session.reset()
                self.say("(conversation cleared)")
            elif name in ("/help", "/?"):
                self.say(f"commands: {COMMANDS}. Ctrl-C stops a reply; Ctrl-D exits.")
            elif name == "/stats":
                self.print_stats(self.session.last) if self.session.last else self.say("(no reply yet)")
                stats = self.session.stats.as_dict()
                self.say(f"[session: {', '.join(f'{k} {v}' for k, v in stats.items())}]")
            elif name == "/save" and arg:
                messages = self.session.messages
                save_conversation(Path(arg), self.engine.name, messages)
                self.say(f"(saved {len(messages)} messages to {arg})")
            elif name == "/load" and arg:
                self.session.replace_messages(load_conversation(Path(arg)))
                self.say(f"(loaded {len(self.session.messages)} messages from {arg})")
            else:
                self.say(f"unknown command {text}; commands: {COMMANDS}")
        except EdgeLLMError as exc:
            self.say(f"error: {exc}")
        return False

    def reply(self, line: str) -> None:
        """Stream one reply; Ctrl-C stops it, and the session keeps the part already shown."""
        stream = self.session.stream(line, self.params)
        try:
            for chunk in stream:
                self.out.write(chunk.text)
                self.out.flush()
        except KeyboardInterrupt:
            stream.close()  # releases the engine now, not at garbage collection
            self.say("\n(stopped)")
        except EdgeLLMError as exc:  # e.g. one message longer than the window: keep the chat alive
            self.say(f"\nerror: {exc} (try /reset)")
        else:
            print(file=self.out)
