"""Fuzz the files edgellm reads: GGUF input to `edgellm convert` (mutated metadata, wrong tensor counts and shapes,
absurd sizes, flipped and truncated bytes) and artifact folders (mutated manifest.json and edgellm-config.json,
safetensors headers with wrong offsets/dtypes/shapes, truncated files, paths escaping the folder).

Property: `edgellm convert` exits 0 or 1 with one `edgellm: error:` line (never the internal-error exit 2 or an
exception), leaves no output folder when it fails; an artifact either loads and generates, or raises a typed
edgellm error.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
gguf = pytest.importorskip("gguf")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from edgellm.artifact.manifest import Manifest, sha256_file  # noqa: E402
from edgellm.cli import main  # noqa: E402
from edgellm.errors import EdgeLLMError  # noqa: E402
from tests.fuzz import examples, tally  # noqa: E402
from tests.fuzz.strategies import SCALARS, json_values  # noqa: E402

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 32, 64, 4, 2, 1


def _byte_tokens() -> list[str]:
    from edgellm.convert.gguf_tokenizer import _byte_alphabet

    alphabet = _byte_alphabet()
    return [alphabet[b] for b in range(256)] + ["<|endoftext|>"]


def write_gguf(path: Path, *, meta: dict[str, Any] | None = None, drop: tuple[str, ...] = (),
               shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """A tiny llama GGUF (byte-level BPE vocabulary, f32 tensors); `meta` overrides metadata, `drop` removes
    tensors, `shapes` gives tensors other shapes."""
    rng = np.random.default_rng(0)
    tokens = _byte_tokens()
    writer = gguf.GGUFWriter(str(path), "llama")
    values: dict[str, Any] = {
        "llama.context_length": 128, "llama.embedding_length": HIDDEN, "llama.block_count": LAYERS,
        "llama.feed_forward_length": FFN, "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS, "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * 256 + [3],
        "tokenizer.ggml.merges": [], "tokenizer.ggml.eos_token_id": 256,
        "tokenizer.chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    } | (meta or {})
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int) and 0 <= value < 2**32:
            writer.add_uint32(key, value)
        elif isinstance(value, int):
            writer.add_int64(key, max(-(2**63), min(value, 2**63 - 1)))
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
    q, kv = HEADS * (HIDDEN // HEADS), KV_HEADS * (HIDDEN // HEADS)
    tensors = {"token_embd.weight": (257, HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        tensors |= {f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                    f"blk.{i}.attn_q.weight": (q, HIDDEN), f"blk.{i}.attn_k.weight": (kv, HIDDEN),
                    f"blk.{i}.attn_v.weight": (kv, HIDDEN), f"blk.{i}.attn_output.weight": (HIDDEN, q),
                    f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
                    f"blk.{i}.ffn_down.weight": (HIDDEN, FFN)}
    tensors |= shapes or {}
    for name, shape in tensors.items():
        if name not in drop:
            writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32) * 0.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def convert_cli(src: Path, out: Path) -> tuple[int, str]:
    """`edgellm convert SRC -o OUT -q q0f32 --quiet` in process: (exit status, stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["convert", str(src), "-o", str(out), "-q", "q0f32", "--quiet"])
    return code, err.getvalue()


def check_convert(src: Path, out: Path) -> None:
    code, err = convert_cli(src, out)
    tally(f"exit {code}")
    assert code in (0, 1), err
    if code == 1:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("edgellm: error: "), err
        assert not out.exists()
        assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], "a partial folder was left"
    else:
        check_artifact(out)


def check_artifact(folder: Path) -> None:
    """Load the artifact and generate two tokens, or get a typed edgellm error."""
    from edgellm.artifact.reader import open_artifact
    from edgellm.runtime.engine import Engine
    from edgellm.generation import GenerationParams

    try:
        engine = Engine(open_artifact(folder), threads=1)
        list(engine.stream([1, 2, 3], GenerationParams(max_tokens=2, temperature=0.0)))
    except EdgeLLMError as exc:
        tally(f"load refused: {type(exc).__name__}")
        assert "\n" not in str(exc).strip()
        return
    tally("loaded")


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_gguf(path)
    return path


def test_the_tiny_gguf_converts_and_runs(good_gguf: Path, tmp_path: Path) -> None:
    """The anchor: unmutated, the generated GGUF converts and runs (so the fuzz below is not all refusals)."""
    code, err = convert_cli(good_gguf, tmp_path / "art")
    assert code == 0, err
    check_artifact(tmp_path / "art")


META_KEYS = ["llama.context_length", "llama.embedding_length", "llama.block_count", "llama.feed_forward_length",
             "llama.attention.head_count", "llama.attention.head_count_kv", "llama.attention.layer_norm_rms_epsilon",
             "llama.rope.freq_base", "llama.vocab_size", "llama.attention.key_length", "general.architecture",
             "llama.rope.scaling.type", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
             "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.eos_token_id",
             "tokenizer.ggml.bos_token_id", "tokenizer.ggml.add_bos_token", "tokenizer.chat_template"]
GGUF_VALUES = (st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.sampled_from([0, 1, 3, 2**31, 10**9])
               | st.floats(allow_nan=True, allow_infinity=True, width=32) | st.text(max_size=10)
               | st.lists(st.text(max_size=3), max_size=5) | st.lists(st.integers(0, 5), max_size=5))
TENSOR_NAMES = ["token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight", "blk.0.ffn_down.weight",
                "blk.0.attn_norm.weight", "output.weight", "blk.0.attn_q.bias", "blk.1.attn_q.weight"]
SHAPES = st.lists(st.integers(1, 80), min_size=1, max_size=3).map(tuple)


@settings(max_examples=examples(60))
@given(meta=st.dictionaries(st.sampled_from(META_KEYS), GGUF_VALUES, max_size=3),
       drop=st.lists(st.sampled_from(TENSOR_NAMES), max_size=2).map(tuple),
       shapes=st.dictionaries(st.sampled_from(TENSOR_NAMES), SHAPES, max_size=2))
def test_convert_mutated_gguf_metadata_and_tensors(meta: dict[str, Any], drop: tuple[str, ...],
                                                   shapes: dict[str, tuple[int, ...]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "m.gguf"
        try:
            write_gguf(src, meta=meta, drop=drop, shapes=shapes)
        except (ValueError, TypeError, OverflowError, struct.error):
            return  # the gguf writer itself refuses this value
        check_convert(src, Path(tmp) / "out")


@settings(max_examples=examples(80))
@given(edits=st.lists(st.tuples(st.integers(0, 4095), st.binary(min_size=1, max_size=8)), min_size=1, max_size=4),
       cut=st.none() | st.integers(0, 40_000),
       counts=st.none() | st.tuples(st.sampled_from([8, 16]), st.sampled_from([0, 1, 2**31, 2**63, 2**64 - 1])))
def test_convert_gguf_with_flipped_or_truncated_bytes(good_gguf: Path, edits: list[tuple[int, bytes]],
                                                      cut: int | None, counts: tuple[int, int] | None) -> None:
    """Random bytes overwritten in the header/metadata, the file cut short, or the tensor count (offset 8) or
    metadata count (offset 16) set to absurd values."""
    data = bytearray(good_gguf.read_bytes())
    for offset, patch in edits:
        data[offset:offset + len(patch)] = patch
    if counts is not None:
        offset, value = counts
        data[offset:offset + 8] = struct.pack("<Q", value)
    if cut is not None:
        del data[cut:]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "m.gguf"
        src.write_bytes(bytes(data))
        check_convert(src, Path(tmp) / "out")


# ---- artifact folders -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_artifact(good_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("art") / "art"
    code, err = convert_cli(good_gguf, out)
    assert code == 0, err
    return out


def _reseal(folder: Path) -> None:
    """Rewrite manifest.json to match the files as they are now (a crafted artifact passes its checksums)."""
    manifest = Manifest.read(folder)
    manifest.files.update({name: type(entry)(sha256_file(folder / name), (folder / name).stat().st_size)
                           for name, entry in manifest.files.items() if (folder / name).is_file()})
    manifest.write(folder)


def _mutate_json(value: Any, path: list[Any], new: Any) -> Any:
    """`value` with the item at `path` (indices into nested dicts/lists, taken modulo their size) replaced by
    `new`; an empty path replaces the whole value."""
    if not path or not isinstance(value, (dict, list)) or not value:
        return new
    keys = list(value) if isinstance(value, dict) else list(range(len(value)))
    key = keys[path[0] % len(keys)]
    value[key] = _mutate_json(value[key], path[1:], new)
    return value


@settings(max_examples=examples(80))
@given(which=st.sampled_from(["edgellm-config.json", "manifest.json", "weights"]),
       path=st.lists(st.integers(0, 50), max_size=4), new=json_values(4) | SCALARS, reseal=st.booleans())
def test_load_mutated_json_files(good_artifact: Path, which: str, path: list[int], new: Any, reseal: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "art"
        shutil.copytree(good_artifact, folder)
        if which == "weights":
            _mutate_safetensors_header(folder / "weights-00001.safetensors", path, new)
        else:
            target = folder / which
            doc = _mutate_json(json.loads(target.read_text()), path, new)
            target.write_text(json.dumps(doc, allow_nan=True))
        if reseal and which != "manifest.json":
            _reseal(folder)
        check_artifact(folder)


def _mutate_safetensors_header(shard: Path, path: list[int], new: Any) -> None:
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header = _mutate_json(header, path, new)
    body = json.dumps(header, allow_nan=True).encode()
    shard.write_bytes(struct.pack("<Q", len(body)) + body + data[8 + length:])


@settings(max_examples=examples(40))
@given(dtype=st.sampled_from(["F32", "F16", "BF16", "I8", "U8", "I32", "I64", "F64", "Q4", ""]),
       offsets=st.tuples(st.integers(-10, 10**7), st.integers(-10, 10**7)) | st.just((0, 2**70)),
       shape=st.lists(st.integers(-2, 10**6), max_size=4), header_len=st.none() | st.sampled_from([0, 7, 2**63]))
def test_load_safetensors_with_wrong_offsets_dtypes_shapes(good_artifact: Path, dtype: str, offsets: tuple[int, int],
                                                           shape: list[int], header_len: int | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "art"
        shutil.copytree(good_artifact, folder)
        shard = folder / "weights-00001.safetensors"
        data = shard.read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + length])
        name = sorted(k for k in header if k != "__metadata__")[0]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": list(offsets)}
        body = json.dumps(header).encode()
        shard.write_bytes(struct.pack("<Q", len(body) if header_len is None else header_len) + body
                          + data[8 + length:])
        _reseal(folder)
        check_artifact(folder)


@pytest.mark.parametrize("name", ["../outside.json", "/etc/passwd", "a/../../b", "~/x", "..\\x", "", "."])
def test_manifest_paths_escaping_the_folder(good_artifact: Path, tmp_path: Path, name: str) -> None:
    folder = tmp_path / "art"
    shutil.copytree(good_artifact, folder)
    (tmp_path / "outside.json").write_text("{}")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": sha256_file(tmp_path / "outside.json"), "size": 2}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    from edgellm.artifact.reader import open_artifact

    # For the right reason: the path itself, not a size or digest mismatch found after following it.
    with pytest.raises(EdgeLLMError, match=f"names an unsafe path {re.escape(repr(name))}"):
        open_artifact(folder)


@settings(max_examples=examples(40))
@given(which=st.sampled_from(["manifest.json", "edgellm-config.json", "tokenizer.json", "weights-00001.safetensors",
                              "chat_template.jinja"]),
       keep=st.floats(0, 1), reseal=st.booleans())
def test_load_truncated_files(good_artifact: Path, which: str, keep: float, reseal: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "art"
        shutil.copytree(good_artifact, folder)
        target = folder / which
        if not target.exists():
            return
        data = target.read_bytes()
        target.write_bytes(data[:int(len(data) * keep)])
        if reseal and which != "manifest.json":
            _reseal(folder)
        check_artifact(folder)
