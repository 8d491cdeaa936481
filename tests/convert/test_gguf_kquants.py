"""The GGUF blocks of the K-quant mixes beyond Q4_K_M (Q5_K_M: Q5_K + Q6_K, with Q5_1 / Q8_0 where a row is not a
multiple of 256; Q3_K_M / Q2_K: Q3_K / Q2_K, with IQ4_NL there) and Q4_0, read from a GGUF file, held exactly at the
file's bytes and run natively.

A tiny random Qwen2 model is written as a GGUF of those types (Q5_1 and Q4_0 from gguf-py's quantizer, the K-quants
and IQ4_NL as random valid blocks, which gguf-py cannot quantize to) and converted at the source scheme and at q0f32, as
tests/test_source_scheme.py does for Q5_0 / Q4_K / Q6_K: every tensor must come back in its own format at the GGUF's
byte count with gguf-py's values, and the native logits must agree with torch's on the float32 weights within the
same tolerances. The per-kernel float64 bounds are tests/test_gguf_blocks.py's; here also the refusals: a truncated
block, a row that is not a whole number of super-blocks.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from edgellm.artifact.reader import open_artifact
from edgellm.convert.gguf_source import read_gguf
from edgellm.convert.pipeline import convert
from edgellm.errors import ArtifactError, UnsupportedModelError, UnsupportedQuantizationError
from edgellm.kernels import native
from edgellm.quant.formats import BLOCK_BYTES, BLOCK_WEIGHTS, EL_FORMAT_CODES, dequantize, interleave, quantize, row_blocks
from edgellm.quant.layout import storage_bytes, weight_shape
from edgellm.runtime.engine import Engine
from tests.quant.test_gguf_blocks import random_blocks
from tests.convert.test_source_scheme import (DECODE_TOL, DIM, FFN, HEAD_DIM, HEADS, KV_HEADS, LAYERS, PREFILL_TOL, _blocks,
                                      _relative, write_tiny_gguf)
from tests.artifact.test_artifact_shapes import assert_one_line_refusal, cli
from tests.support.artifact_craft import load_in_child, replace_tensor
from tests.support.tiny import VOCAB

FORMAT_OF = {T.Q5_1: "q5_1", T.Q2_K: "q2_k", T.Q3_K: "q3_k", T.Q5_K: "q5_k", T.Q6_K: "q6_k", T.Q5_0: "q5_0",
             T.Q8_0: "q8", T.IQ4_NL: "iq4_nl", T.Q4_0: "q4_0"}
# per layer: a Q5_K_M-like part (Q5_K / Q5_1), a Q3_K_M / Q2_K-like part (Q3_K / Q2_K / IQ4_NL) and a Q4_0 tensor
LAYER_TENSORS = {"attn_q": (T.Q5_1, (HEADS * HEAD_DIM, DIM)), "attn_k": (T.IQ4_NL, (KV_HEADS * HEAD_DIM, DIM)),
                 "attn_v": (T.Q5_K, (KV_HEADS * HEAD_DIM, DIM)), "attn_output": (T.Q3_K, (DIM, HEADS * HEAD_DIM)),
                 "ffn_gate": (T.Q2_K, (FFN, DIM)), "ffn_up": (T.Q4_0, (FFN, DIM)), "ffn_down": (T.Q3_K, (DIM, FFN))}


def _iq4_nl_blocks(shape: tuple[int, int], seed: int) -> np.ndarray:
    """Random IQ4_NL blocks (f16 d of about 2e-3, 16 random nibble bytes) [N, K / 32 * 18]."""
    g = np.random.default_rng(seed)
    n, nb = shape[0], shape[1] // 32
    raw = g.integers(0, 256, (n, nb, 18), dtype=np.uint8)
    raw[..., 0:2] = (2e-3 * 2.0 ** g.uniform(-1, 1, (n, nb))).astype(np.float16).view(np.uint8).reshape(n, nb, 2)
    return raw.reshape(n, -1)


def make_blocks(qtype: T, shape: tuple[int, int], seed: int) -> np.ndarray:
    if qtype in (T.Q5_1, T.Q4_0):
        w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.08
        return gguf_quantize(w, qtype)
    if qtype == T.IQ4_NL:
        return _iq4_nl_blocks(shape, seed)
    if qtype in (T.Q2_K, T.Q3_K, T.Q5_K):
        return random_blocks(FORMAT_OF[qtype], *shape, seed=seed, magnitude=3e-4).numpy()
    return _blocks(qtype, shape, seed)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    path = tmp_path_factory.mktemp("kquants") / "tiny.gguf"
    return path, write_tiny_gguf(path, LAYER_TENSORS, make_blocks)


def test_each_tensor_is_read_as_its_own_blocks_with_gguf_pys_values(tiny: tuple[Path, int], tmp_path: Path) -> None:
    path, matmul_bytes = tiny
    source = read_gguf(path)
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    for hf, name in source_names().items():
        qtype = tensors[name].tensor_type
        fmt = FORMAT_OF[qtype]
        assert source.exact_formats(hf)[0] == fmt, name
        blocks = source.load_blocks(hf, fmt)
        assert blocks is not None
        want = gguf_dequantize(tensors[name].data, qtype).astype(np.float32).reshape(blocks.shape[0], -1)
        got = dequantize({"qweight": interleave(blocks, fmt)}, fmt).numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name
    art = open_artifact(convert(path, tmp_path / "art", progress=False))
    formats = art.config.quantization.formats
    assert Counter(formats.values()) == {"q5_1": LAYERS, "q5_k": LAYERS, "q3_k": 2 * LAYERS, "q2_k": LAYERS,
                                         "iq4_nl": LAYERS, "q4_0": LAYERS, "q8": 1, "q5_0": 1}
    assert formats["model.layers.0.mlp.down_proj"] == "q3_k" and formats["model.layers.1.mlp.gate_proj"] == "q2_k"
    stored = sum(t.nbytes for name, t in art.weights().items() if name.endswith(".qweight"))
    assert stored == matmul_bytes  # every block at the GGUF's own bytes (IQ4_NL and Q4_0 too: 18 bytes a block)


def source_names() -> dict[str, str]:
    """HF tensor name -> GGUF tensor name of the tiny model's layer weights (the Qwen2 family's mapping)."""
    roles = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    return {f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for i in range(LAYERS) for g, hf in roles.items()}


@pytest.mark.skipif(native.load_library() is None, reason="no native kernel library on this machine")
def test_the_mix_runs_natively_as_torch_runs_the_float_weights(tiny: tuple[Path, int], tmp_path: Path) -> None:
    path, _ = tiny
    source = Engine(open_artifact(convert(path, tmp_path / "source", progress=False)), threads=1)
    reference = Engine(open_artifact(convert(path, tmp_path / "f32", quantization="q0f32", progress=False)),
                       threads=1, runtime="torch")
    assert source.decode_path.startswith("native"), source.decode_path
    ids = [int(i) for i in np.random.default_rng(7).integers(0, VOCAB - 2, 24)]
    want = torch.as_tensor(np.asarray(reference.logits(ids)))
    prefill = torch.as_tensor(np.asarray(source.logits(ids)))
    decode = torch.as_tensor(np.asarray(source.logits(ids, step_from=1)))
    assert _relative(prefill, want) <= PREFILL_TOL[native.prefill_matmul() or "f32"]
    assert _relative(decode[1:], want[1:]) <= DECODE_TOL


# ---------------------------------------------------------------------------- refusals

NEW = ("q5_1", "q2_k", "q3_k", "q5_k", "q4_0", "iq4_nl")


@pytest.mark.parametrize("fmt", NEW)
def test_a_truncated_block_is_refused(fmt: str) -> None:
    k = 64 if BLOCK_WEIGHTS[fmt] == 32 else 512
    stored = interleave(random_blocks(fmt, 16, k, seed=3), fmt)
    assert weight_shape(fmt, {"qweight": stored}) == (16, k)
    with pytest.raises(ArtifactError, match=f"not whole {8 * BLOCK_BYTES[fmt]}-byte blocks"):
        weight_shape(fmt, {"qweight": stored[:, :-1]})
    with pytest.raises(UnsupportedQuantizationError, match="no .* quantizer"):
        quantize(torch.zeros(8, 256), fmt)


def test_a_truncated_gguf_tensor_is_refused_in_one_line(tiny: tuple[Path, int], tmp_path: Path) -> None:
    data = tiny[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - BLOCK_BYTES["q3_k"] // 2])  # the last tensor's last block cut in half
    with pytest.raises(UnsupportedModelError, match="not a readable GGUF file"):
        read_gguf(cut)


@pytest.mark.parametrize("fmt", ("q2_k", "q3_k", "q5_k"))
def test_a_row_not_a_whole_number_of_super_blocks_is_refused(fmt: str) -> None:
    with pytest.raises(UnsupportedQuantizationError, match="K to be a multiple of 256"):
        storage_bytes(fmt, (8, 288))
    assert np.array_equal(row_blocks(interleave(random_blocks(fmt, 8, 256, seed=4), fmt), fmt).numpy(),
                          random_blocks(fmt, 8, 256, seed=4).numpy())
    lib = native.load_library()
    if lib is None:
        pytest.skip("no native kernel library on this machine")
    x, y = torch.ones(288), torch.zeros(8)
    blob = torch.zeros(8 * BLOCK_BYTES[fmt] * 2, dtype=torch.uint8)
    code = EL_FORMAT_CODES[fmt]
    assert lib.el_linear(None, code, blob.data_ptr(), 8, 288, x.data_ptr(), 1, y.data_ptr()) == -1
    assert lib.el_gemm_f32(None, code, blob.data_ptr(), 8, 288, x.data_ptr(), 1, y.data_ptr()) == -1
    out = torch.zeros(8, 288, dtype=torch.int16)
    assert lib.el_dequant_bf16(None, code, blob.data_ptr(), 288, 0, 8, out.data_ptr()) == -1
    assert lib.el_linear(None, code, blob.data_ptr(), 8, 256, x.data_ptr(), 1, y.data_ptr()) == 0  # one whole one


@pytest.mark.parametrize("fmt", ("q4_0", "iq4_nl"))
def test_an_artifact_with_a_wrong_sized_18_byte_block_tensor_is_refused(tiny: tuple[Path, int], tmp_path: Path,
                                                                         fmt: str) -> None:
    """The artifact checker takes q4_0 / iq4_nl sizes from the layout: the same tensor at q8's 34-byte blocks (how
    these types were held before) or cut by one group is refused naming it, by verify and by a native load alike."""
    folder = convert(tiny[0], tmp_path / "art", progress=False)
    formats = open_artifact(folder).config.quantization.formats
    prefix = next(p for p, f in formats.items() if f == fmt)
    name = f"{prefix}.qweight"
    good = open_artifact(folder).weights()[name].numpy()
    n, k = good.shape[0] * 8, good.shape[1] // (8 * BLOCK_BYTES[fmt]) * 32
    for bad in (np.zeros((n // 8, k // 32 * BLOCK_BYTES["q8"] * 8), np.uint8), good[:-1]):
        replace_tensor(folder, name, bad)
        code, out, err = cli("verify", str(folder))
        assert code == 1 and not out
        assert_one_line_refusal(err, name)
        if native.load_library() is not None:
            done = load_in_child(folder, "native")
            assert done.returncode == 3 and name in done.stderr, (done.returncode, done.stderr[-2000:])
