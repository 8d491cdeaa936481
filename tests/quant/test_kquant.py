"""The K-quant quantizer from float weights (quant/kquant.py) and the per-tensor mixes (quant/mixes.py).

* the bytes are GGUF blocks: gguf-py's ``dequantize`` of them equals quant/formats' dequantization bit for bit;
* the search loses no more than llama.cpp's own reference quantizer (ggml_quantize_chunk from llama-cpp-python's
  libggml, no importance matrix) on the same tensors, in squared error;
* the q4_k_m mix gives each tensor the block type llama.cpp's Q4_K_M recipe gave it in the catalog's GGUF files;
* `convert <hf folder> -q q4_k_m` writes those blocks, and the artifact runs.
"""

from __future__ import annotations

import ctypes
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize

from edgellm.convert.gguf_source import read_gguf
from edgellm.errors import UnsupportedQuantizationError
from edgellm.families.registry import weight_shapes
from edgellm.quant.formats import dequant_rows, dequantize, quantize, row_blocks
from edgellm.quant.kquant import quantize_blocks
from edgellm.quant.mixes import mix_formats
from tests.support.tiny import VOCAB, _save_tokenizer

QTYPES = {"q5_0": T.Q5_0, "q4_k": T.Q4_K, "q6_k": T.Q6_K}
GGML_CODES = {"q5_0": 6, "q4_k": 12, "q6_k": 14}  # enum ggml_type


def awkward_weights(n: int, k: int, seed: int) -> np.ndarray:
    """Heavy-tailed weights with uneven columns, plus rows that are zero, constant, one-signed or one outlier."""
    g = np.random.default_rng(seed)
    w = (g.standard_t(3, (n, k)) * g.uniform(0.2, 3.0, (1, k)) * 0.02).astype(np.float32)
    w[0] = 0
    w[1] = 0.25  # (large enough that the scales are normal halves: 0.01 / 31 / 128 is a subnormal one)
    w[2] = np.abs(w[2])
    w[3] = -np.abs(w[3])
    w[4] = 0
    w[4, 7] = 5.0
    return w


def gguf_values(blocks: np.ndarray, fmt: str, shape: tuple[int, int]) -> np.ndarray:
    return gguf_dequantize(blocks, QTYPES[fmt]).astype(np.float32).reshape(shape)


@pytest.mark.parametrize("fmt", list(QTYPES))
def test_the_blocks_are_gguf_blocks(fmt: str) -> None:
    w = awkward_weights(16, 512, seed=1)
    blocks = quantize_blocks(w, fmt)
    ref = gguf_values(blocks, fmt, w.shape)
    own = dequant_rows(torch.from_numpy(blocks), fmt).numpy()
    assert np.array_equal(ref.view(np.uint32), own.view(np.uint32))
    assert np.all(ref[0] == 0) and np.all(ref[4, np.arange(512) != 7] == 0)
    assert abs(ref[4, 7] - 5.0) < 5.0 * 2.0**-9  # a lone outlier is held to its scale's f16 precision
    assert np.allclose(ref[1], 0.25, rtol=2.0**-9)  # a constant row too
    # the heavy-tailed rows within the format's usual relative error (measured 0.0086, 0.00067, 0.0046: a 4-, 6-, 5-bit
    # grid with the scales' overhead) -- a misplaced field or nibble costs orders of magnitude more
    rel = np.sum((ref[5:] - w[5:]) ** 2) / np.sum(w[5:] ** 2)
    assert rel < {"q4_k": 0.012, "q6_k": 0.001, "q5_0": 0.0065}[fmt]
    # the stored weight (interleaved groups of 8 rows) is the same blocks
    parts = quantize(torch.from_numpy(w), fmt)
    assert torch.equal(row_blocks(parts["qweight"], fmt), torch.from_numpy(blocks))
    assert np.array_equal(dequantize(parts, fmt).numpy(), ref)


def _ggml() -> ctypes.CDLL | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    path = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    if not path.is_file():
        return None
    lib = ctypes.CDLL(str(path))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_void_p]
    return lib


GGML = _ggml()


def ggml_blocks(w: np.ndarray, fmt: str) -> np.ndarray:
    """llama.cpp's quantization of w (its reference quantizer: no importance matrix)."""
    assert GGML is not None
    w = np.ascontiguousarray(w, np.float32)
    out = np.zeros_like(quantize_blocks(w[:1], fmt), shape=(w.shape[0], quantize_blocks(w[:1], fmt).shape[1]))
    written = GGML.ggml_quantize_chunk(GGML_CODES[fmt], w.ctypes.data, out.ctypes.data, 0, w.shape[0], w.shape[1], None)
    assert written == out.nbytes
    return out


@pytest.mark.skipif(GGML is None, reason="llama-cpp-python's libggml is not installed")
@pytest.mark.parametrize("fmt", list(QTYPES))
@pytest.mark.parametrize("kind", ["gauss", "heavy-tailed"])
def test_the_error_is_no_more_than_llama_cpp_s(fmt: str, kind: str) -> None:
    g = np.random.default_rng(7)
    w = (g.standard_normal((256, 1024)) if kind == "gauss" else awkward_weights(256, 1024, seed=7)).astype(np.float32)
    ours = gguf_values(quantize_blocks(w, fmt), fmt, w.shape).astype(np.float64)
    theirs = gguf_values(ggml_blocks(w, fmt), fmt, w.shape).astype(np.float64)
    assert np.sum((ours - w) ** 2) <= np.sum((theirs - w) ** 2)


def test_quantize_blocks_refuses_bad_input() -> None:
    with pytest.raises(UnsupportedQuantizationError, match="multiple of 256"):
        quantize_blocks(np.zeros((8, 288), np.float32), "q4_k")
    with pytest.raises(UnsupportedQuantizationError, match="multiple of 32"):
        quantize_blocks(np.zeros((8, 48), np.float32), "q5_0")
    with pytest.raises(UnsupportedQuantizationError, match="2-D"):
        quantize_blocks(np.zeros(256, np.float32), "q6_k")
    with pytest.raises(UnsupportedQuantizationError, match="no K-quant quantizer"):
        quantize_blocks(np.zeros((8, 256), np.float32), "q3_k")
    bad = np.zeros((8, 256), np.float32)
    bad[3, 3] = np.nan
    with pytest.raises(UnsupportedQuantizationError, match="NaN"):
        quantize_blocks(bad, "q4_k")
    for fmt in QTYPES:
        with pytest.raises(UnsupportedQuantizationError, match="overflows float16"):
            quantize_blocks(np.full((8, 256), 3e9, np.float32), fmt)
    with pytest.raises(UnsupportedQuantizationError, match="multiple of 8"):
        quantize(torch.zeros(12, 256), "q4_k")


_GGUF_FORMATS = {T.Q4_K: "q4_k", T.Q6_K: "q6_k", T.Q5_0: "q5_0", T.Q8_0: "q8"}


@pytest.mark.parametrize("model", ["qwen", "gemma3"])
def test_the_q4_k_m_mix_is_llama_cpp_s_recipe(model: str, qwen_gguf: Path, gemma3_gguf: Path) -> None:
    """The catalog's Qwen2.5-Coder and Gemma 3 files are llama.cpp Q4_K_M quantizations: every weight's type there is
    the one the mix picks for the same config, the layers ranked in the file's order (as llama-quantize counts them)."""
    from edgellm.families.registry import family_for_gguf

    path = qwen_gguf if model == "qwen" else gemma3_gguf
    reader = GGUFReader(path)
    cfg = read_gguf(path).config
    types = {t.name: t.tensor_type for t in reader.tensors}
    downs = [int(t.name.split(".")[1]) for t in reader.tensors if t.name.endswith("ffn_down.weight")]
    position = {layer: rank for rank, layer in enumerate(downs)}
    ours = mix_formats("q4_k_m", weight_shapes(cfg), cfg.num_hidden_layers, cfg.tie_word_embeddings, position)
    sources = family_for_gguf(reader.fields["general.architecture"].contents()).gguf_sources(cfg)
    theirs = {prefix: _GGUF_FORMATS[types[sources[f"{prefix}.weight"].name]] for prefix in ours}
    assert ours == theirs
    assert {"q4_k", "q6_k", "q5_0", "q8"} <= set(ours.values())


def test_mixes_fall_back_where_k_is_not_a_multiple_of_256() -> None:
    shapes = {"lm_head": (256, 640), "model.embed_tokens": (256, 512), "model.layers.0.self_attn.v_proj": (64, 640),
              "model.layers.1.self_attn.v_proj": (64, 640), "model.layers.1.mlp.down_proj": (8, 48),
              "model.layers.1.mlp.up_proj": (12, 512)}
    assert mix_formats("q4_k_m", shapes, 8, tied=False) == {
        "lm_head": "q8", "model.embed_tokens": "q4_k", "model.layers.0.self_attn.v_proj": "q8",
        "model.layers.1.self_attn.v_proj": "q5_0", "model.layers.1.mlp.down_proj": "f16",
        "model.layers.1.mlp.up_proj": "f16"}
    assert set(mix_formats("q6_k", shapes, 8, tied=True).values()) == {"q8", "q6_k", "f16"}
    with pytest.raises(ValueError, match="unknown K-quant mix"):
        mix_formats("q3_k_m", shapes, 8, tied=True)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 8-layer Qwen2 whose K is 256 or 512 (the 256-weight blocks fit), untied, its final norm scaled 16x so
    the next-token distributions are peaked (a quantizer that blurs the weights moves KL by orders of magnitude)."""
    folder = tmp_path_factory.mktemp("kq") / "hf"
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=False, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(16.0)
    model.save_pretrained(folder, safe_serialization=True)
    _save_tokenizer(folder)
    return folder


IDS = [(7 * i + 3) % (VOCAB - 2) for i in range(48)]


def _log_probs(folder: Path, out: Path, scheme: str) -> torch.Tensor:
    from edgellm.artifact.reader import open_artifact
    from edgellm.convert.pipeline import convert
    from edgellm.runtime.engine import Engine

    engine = Engine(open_artifact(convert(folder, out, quantization=scheme, progress=False)), threads=1)
    return torch.log_softmax(engine.logits(IDS).double(), -1)


def test_convert_from_hf_writes_the_mix(hf_folder: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from edgellm.artifact.reader import open_artifact
    from edgellm.convert.pipeline import convert

    art = open_artifact(convert(hf_folder, tmp_path / "art", quantization="q4_k_m", progress=False))
    formats = art.config.quantization.formats
    assert art.config.quantization.scheme == "q4_k_m"
    assert {p for p, f in formats.items() if f == "q6_k"} == {"lm_head"} | {
        f"model.layers.{i}.{t}" for i in (0, 3, 6, 7) for t in ("self_attn.v_proj", "mlp.down_proj")}
    assert set(formats.values()) == {"q4_k", "q6_k"}
    source = load_file(str(next(hf_folder.glob("*.safetensors"))))
    weights = art.weights()
    for prefix, fmt in formats.items():  # every stored weight is the quantizer's blocks of the HF tensor
        w = source[f"{prefix}.weight"].float().numpy()
        got = dequantize({"qweight": weights[f"{prefix}.qweight"]}, fmt).numpy()
        assert np.array_equal(got, gguf_values(quantize_blocks(w, fmt), fmt, w.shape)), prefix


def test_the_mix_stays_as_close_to_float_as_llama_cpp_s(hf_folder: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """KL to the float model of the q4_k_m artifact, against the same artifact with llama.cpp's blocks of each tensor
    (its reference quantizer, the same mix): no worse; and more bits (q6_k) are closer still."""
    base = _log_probs(hf_folder, tmp_path / "f32", "q0f32")
    assert base.exp().amax(-1).mean() > 0.4  # peaked

    def kl(scheme: str, out: str) -> float:
        return float((base.exp() * (base - _log_probs(hf_folder, tmp_path / out, scheme))).sum(-1).mean())

    ours = {s: kl(s, s) for s in ("q4_k_m", "q6_k")}
    if GGML is not None:
        from edgellm.quant import formats

        monkeypatch.setattr(formats, "quantize_blocks", ggml_blocks)
        theirs = kl("q4_k_m", "ggml")
        print(ours, theirs)
        assert ours["q4_k_m"] <= theirs
    assert ours["q6_k"] < ours["q4_k_m"] / 4
