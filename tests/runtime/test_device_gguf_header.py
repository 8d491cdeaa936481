"""The GGUF header reader the memory planner uses (edgellm.runtime.gguf_header) against gguf's own reader,
and the planner's catalog configs from it against a full read of the same file."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from edgellm.catalog import get_entry
from edgellm.errors import MemoryBudgetError, UnsupportedModelError
from edgellm.paths import sources_dir
from edgellm.runtime import planner
from edgellm.runtime.gguf_header import LONG_ARRAY, read_gguf_header


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Scalars of every width, short and long arrays of strings and numbers, tensors of three block types."""
    path = tmp_path_factory.mktemp("gguf") / "t.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_uint32("llama.block_count", 7)
    w.add_int64("x.int64", -5)
    w.add_float32("x.f32", 0.25)
    w.add_float64("x.f64", 1e-300)
    w.add_bool("x.bool", True)
    w.add_uint8("x.u8", 200)
    w.add_string("x.name", "héllo")
    w.add_array("x.short", [1, 2, 3])
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(LONG_ARRAY + 5)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(LONG_ARRAY * 2)])
    w.add_array("x.short_strings", ["a", "bc"])
    w.add_uint16("x.after", 65535)  # read correctly only if the long arrays were stepped over exactly
    w.add_tensor("a.weight", np.ones((4, 32), dtype=np.float32))
    w.add_tensor("b.weight", np.ones((2, 64), dtype=np.float16))
    w.add_tensor("c.weight", np.zeros((2, 34), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_header_agrees_with_gguf_reader(gguf_file: Path) -> None:
    reference = gguf.GGUFReader(gguf_file)
    header = read_gguf_header(gguf_file)
    for key, field in reference.fields.items():
        if key.startswith("GGUF."):  # the reader's own entries: version and counts
            continue
        if len(field.types) > 1 and field.types[0] == gguf.GGUFValueType.ARRAY:
            assert header.array_lengths[key] == len(field.data)
            if len(field.data) > LONG_ARRAY:
                assert key not in header.fields
                continue
        value = field.contents()
        assert header.fields[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    assert header.fields["x.after"] == 65535 and header.fields["x.name"] == "héllo"
    assert header.tensor_types == {t.name: int(t.tensor_type) for t in reference.tensors}
    assert header.tensor_types["c.weight"] == gguf.GGMLQuantizationType.Q8_0


def test_damaged_files_are_refused(gguf_file: Path, tmp_path: Path) -> None:
    data = gguf_file.read_bytes()
    cases = {"magic": b"GGUX" + data[4:], "version": data[:4] + b"\x09\0\0\0" + data[8:],
             "truncated": data[:200], "empty": b""}
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(UnsupportedModelError, match="is not a readable GGUF file"):
            read_gguf_header(tmp_path / name)


def _pulled(name: str) -> Path:
    path = sources_dir() / name / get_entry(name).filename
    if not path.is_file():
        pytest.skip(f"{name} is not pulled in this EDGELLM_HOME")
    return path


@pytest.mark.parametrize("name", ["smollm2-135m", pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow),
                                  pytest.param("gemma3-270m", marks=pytest.mark.slow)])
def test_catalog_config_from_the_header_is_the_full_reads(name: str) -> None:
    """The planner's config of a pulled model is what compiling it would give: the same model config and
    weight formats (GGUF blocks kept exactly) as from a full read_gguf of the file (3-17 s each)."""
    from edgellm.convert.gguf_source import read_gguf
    from edgellm.convert.pipeline import weight_formats

    path, scheme = _pulled(name), get_entry(name).default_scheme
    fast = planner._gguf_config(path, name, scheme)
    full = read_gguf(path, name=name, sha256="-")
    assert fast.model == full.config
    assert fast.quantization.formats == weight_formats(full.config, scheme, exact_formats=full.exact_formats)
    assert (fast.tokenizer.bos_token_id, fast.tokenizer.eos_token_id) == (full.tokenizer.bos_token_id,
                                                                          full.tokenizer.eos_token_id)


def test_a_refusal_parses_no_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over budget, the planner weighs every pulled catalog model (the refusal lists smaller ones) from
    headers alone: gguf's full reader, which parses the vocabularies (15 s for Qwen's), is never called."""
    def refuse(*args, **kwargs):
        raise AssertionError("the planner parsed a whole GGUF file")

    monkeypatch.setattr(gguf.GGUFReader, "__init__", refuse)
    _pulled("smollm2-135m")
    pulled = [n for n in ("qwen2.5-coder-0.5b", "gemma3-270m") if (sources_dir() / n / get_entry(n).filename).is_file()]
    configs = {name: planner._catalog_config(name) for name in pulled}
    assert all(c is not None and c.source.name == name for name, c in configs.items())
    with pytest.raises(MemoryBudgetError, match="MiB needed > 1 MiB budget"):
        planner.plan_load("smollm2-135m", memory_budget=2**20, progress=False)
