"""A release whose canary fails is never activated: the current version keeps answering, byte for byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from edgellm.convert.pipeline import convert
from edgellm.store.local import Store
from edgellm.updates.update import CanaryError, update
from tests.support.channel_server import ChannelServer
from tests.store.test_store import PROMPT, home, key, reply, server, versions  # noqa: F401  (fixtures)

from edgellm.store.channel import publish


@pytest.fixture(scope="module")
def broken(versions: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """v1's weights with a chat template that refuses every conversation: it loads, but cannot answer."""
    root = tmp_path_factory.mktemp("broken")
    hf = versions["1"].parent / "hf"
    shutil.copytree(hf, root / "hf")
    (root / "hf" / "chat_template.jinja").write_text("{{ raise_exception('this release is broken') }}")
    return convert(root / "hf", root / "v2", quantization="q4f16_1", progress=False)


def test_a_failed_canary_keeps_the_current_version(versions: dict[str, Path], broken: Path,  # noqa: F811
                                                   home: Path, key: Path, server: ChannelServer) -> None:  # noqa: F811
    publish(versions["1"], server.root, "tiny", "1", key)
    update("tiny", server.url)
    before = reply("tiny")
    publish(broken, server.root, "tiny", "2", key)
    said: list[str] = []
    with pytest.raises(CanaryError, match="canary failed: .*this release is broken.*not activated"):
        update("tiny", server.url, canary=PROMPT, say=said.append)
    refs = Store().refs("tiny")
    assert refs.current == "1"
    assert "2" not in Store().versions("tiny")
    assert reply("tiny") == before
    assert not any("current is now" in line for line in said)
