"""Fuzz an artifact's headers through `Engine.load` on the native runtime (issue 29): the model sizes in
edgellm-config.json, the sizes in manifest.json, and the dtype, shape and data offsets of tensors in a shard header,
each resealed into the manifest (as a crafted artifact would be) or not.

Property: the child process that loads the artifact and generates two tokens exits 0, or 3 with one line naming a
typed edgellm error; never a signal (native code reading outside what it was given), never a traceback; and it
exits 3 whenever the edit alone says the tensors are no longer the config's (a dtype or shape changed, a size
the tensors follow changed): reading past a short vector need not crash (on these tiny models it reads heap
garbage instead), so running at all is a failure there. The load runs in a child so that a crash is a failed
example, not a crashed test run.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from edgellm.kernels import native  # noqa: E402
from tests.support.artifact_craft import load_in_child, read_header, reseal, write_header  # noqa: E402
from tests.fuzz import examples, tally  # noqa: E402

pytestmark = pytest.mark.skipif(native.load_library() is None, reason="no native kernel library on this machine")

ITEM = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I8": 1, "I32": 4, "I64": 8}
SIZES = st.sampled_from([0, 1, 2, 3, 8, 16, 32, 48, 64, 96, 128, 256, 2**31 - 1, 2**31, 2**32 + 64, -1, -64])
MODEL_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window"]
FLAGS = ["tie_word_embeddings", "attention_bias"]
# the vectors the native decoder reads through bare pointers, and a few matrices
TENSORS = ["model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight",
           "model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.v_proj.bias",
           "model.embed_tokens.qweight", "model.layers.0.mlp.down_proj.qweight", "lm_head.qweight"]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from edgellm.convert.pipeline import convert
    from tests.support.tiny import make_tiny

    root = tmp_path_factory.mktemp("native-fuzz")
    make_tiny(root / "hf", "qwen2", tied=False)
    return convert(root / "hf", root / "art", quantization="q8f16_1", progress=False)


def test_the_fuzzed_artifact_loads_natively(artifact: Path) -> None:
    """The anchor: unmutated, the child loads it on the native runtime and generates."""
    done = load_in_child(artifact, "native")
    assert done.returncode == 0, done.stderr[-2000:]


def _check(folder: Path, *, must_refuse: bool) -> None:
    """`must_refuse`: the artifact no longer holds the tensors its config describes (judged from the edit alone),
    so even a load that would not crash must not run it."""
    done = load_in_child(folder, "native")
    assert done.returncode in ((3,) if must_refuse else (0, 3)), (done.returncode, done.stderr[-3000:])
    if done.returncode == 3:
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    tally("loaded" if done.returncode == 0 else "refused")


def _shard_with(folder: Path, tensor: str) -> Path | None:
    return next((s for s in sorted(folder.glob("weights-*.safetensors")) if tensor in read_header(s)[0]), None)


@settings(max_examples=examples(14))
@given(tensor=st.sampled_from(TENSORS), dtype=st.sampled_from([*ITEM, "F64", "", 7]),
       shape=st.lists(st.integers(-2, 300), max_size=3) | st.lists(st.sampled_from([1, 2, 3, 8, 63, 64, 65]),
                                                                   min_size=1, max_size=2),
       offsets=st.none() | st.tuples(st.integers(-16, 1 << 16), st.integers(-16, 1 << 16)) | st.just((0, 1 << 70)),
       reseal_it=st.booleans())
def test_native_load_survives_a_fuzzed_shard_header(artifact: Path, tensor: str, dtype: Any, shape: list[int],
                                                    offsets: tuple[int, int] | None, reseal_it: bool) -> None:
    """A tensor's entry rewritten: `offsets` None keeps its start and makes the length fit the new dtype and shape
    (a consistent header, as a crafted artifact has); otherwise they are taken as given."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "art"
        shutil.copytree(artifact, folder)
        shard = _shard_with(folder, tensor)
        assert shard is not None
        header, body = read_header(shard)
        changed = dtype != header[tensor]["dtype"] or shape != header[tensor]["shape"]
        if offsets is None:
            start = header[tensor]["data_offsets"][0]
            offsets = (start, start + math.prod(shape) * ITEM.get(dtype if isinstance(dtype, str) else "", 1))
        header[tensor] = {"dtype": dtype, "shape": shape, "data_offsets": list(offsets)}
        write_header(shard, header, body)
        if reseal_it:
            reseal(folder)
        _check(folder, must_refuse=changed)


SHAPING = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias"}  # what the tensors follow


@settings(max_examples=examples(8))
@given(edits=st.dictionaries(st.sampled_from(MODEL_FIELDS + FLAGS), SIZES | st.booleans(), min_size=1, max_size=2),
       reseal_it=st.booleans())
def test_native_load_survives_fuzzed_model_sizes(artifact: Path, edits: dict[str, Any], reseal_it: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "art"
        shutil.copytree(artifact, folder)
        config = json.loads((folder / "edgellm-config.json").read_text())
        changed = any(config["model"][k] != v or type(config["model"][k]) is not type(v)
                      for k, v in edits.items() if k in SHAPING)
        config["model"] |= edits
        (folder / "edgellm-config.json").write_text(json.dumps(config))
        if reseal_it:
            reseal(folder)
        _check(folder, must_refuse=changed)


@settings(max_examples=examples(3))
@given(member=st.sampled_from(["weights-00001.safetensors", "weights-00002.safetensors", "tokenizer.json"]),
       size=st.sampled_from([0, 1, 8, 100, 10**12, -1]), count=st.sampled_from([None, 0, -5, 10**18]))
def test_native_load_survives_fuzzed_manifest_sizes(artifact: Path, member: str, size: int,
                                                    count: int | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "art"
        shutil.copytree(artifact, folder)
        manifest = json.loads((folder / "manifest.json").read_text())
        real = manifest["files"][member]["size"]
        manifest["files"][member]["size"] = size
        if count is not None:
            manifest["parameter_count"] = count
        (folder / "manifest.json").write_text(json.dumps(manifest))
        _check(folder, must_refuse=size != real)
