"""The source scheme: a GGUF's own blocks (Q5_0, Q4_K, Q6_K, Q8_0 here) held exactly and run natively.

A tiny random Qwen2 model is written as a GGUF with those block types (Q5_0 from gguf-py's quantizer, the K-quants as
random valid blocks, which gguf-py cannot quantize to) and converted twice: at the default scheme (source) and at
q0f32 (the same values dequantized to float32, run on torch's path). The source artifact must store each tensor in
its own format at exactly the GGUF's byte count, and its native logits must agree with torch's on the float32
weights, row by row (relative L2): prefill within its GEMM's rounding (float32: measured 0.24%; AVX512-BF16, weights
and inputs rounded to bf16: 3.0%; el_gemm_i8, inputs quantized as the decode step's: as the decode, DECODE_TOL), one
token at a time within the int8 activations' (measured 4.8% on this model;
the per-kernel bounds are tests/test_gguf_blocks.py's). A wrong kernel or a misread block is 50-100% off.
"""

from __future__ import annotations

import dataclasses

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize as gguf_quantize

from edgellm.artifact.reader import open_artifact
from edgellm.convert.pipeline import convert, weight_formats
from edgellm.errors import UnsupportedQuantizationError
from edgellm.kernels import native
from edgellm.quant.layout import format_summary, storage_bytes
from edgellm.runtime.engine import Engine
from tests.quant.test_gguf_blocks import random_blocks
from tests.support.gguf_writer import add_placeholder_vocab
from tests.support.tiny import VOCAB

PREFILL_TOL = {"f32": 0.01, "bf16": 0.05, "int8": 0.08}  # relative row error by prefill GEMM, module doc
DECODE_TOL = 0.08
DIM, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 2, 4, 2, 64
# GGUF tensor (per layer) -> (block type, [N, K])
LAYER_TENSORS = {"attn_q": (T.Q5_0, (HEADS * HEAD_DIM, DIM)), "attn_k": (T.Q5_0, (KV_HEADS * HEAD_DIM, DIM)),
                 "attn_v": (T.Q8_0, (KV_HEADS * HEAD_DIM, DIM)), "attn_output": (T.Q4_K, (DIM, HEADS * HEAD_DIM)),
                 "ffn_gate": (T.Q5_0, (FFN, DIM)), "ffn_up": (T.Q4_K, (FFN, DIM)), "ffn_down": (T.Q6_K, (DIM, FFN))}
FORMAT_OF = {T.Q5_0: "q5_0", T.Q4_K: "q4_k", T.Q6_K: "q6_k", T.Q8_0: "q8"}


def _blocks(qtype: T, shape: tuple[int, int], seed: int) -> np.ndarray:
    if qtype in (T.Q5_0, T.Q8_0):
        w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.08
        return gguf_quantize(w, qtype)
    return random_blocks(FORMAT_OF[qtype], *shape, seed=seed, magnitude=2e-4).numpy()


LayerTensors = dict[str, tuple[T, tuple[int, int]]]


def write_tiny_gguf(path: Path, layer_tensors: LayerTensors = LAYER_TENSORS,
                    make_blocks: Callable[[T, tuple[int, int], int], np.ndarray] = _blocks) -> int:
    """A 2-layer Qwen2 GGUF of those block types (``layer_tensors``: GGUF name per layer -> type, shape; the blocks from
    ``make_blocks(type, shape, seed)``); returns the bytes of its matmul tensors."""
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(128)
    w.add_embedding_length(DIM)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    add_placeholder_vocab(w, VOCAB)
    rng = np.random.default_rng(0)
    matmul_bytes = 0

    def add(name: str, qtype: T, shape: tuple[int, int], seed: int) -> None:
        nonlocal matmul_bytes
        raw = make_blocks(qtype, shape, seed)
        matmul_bytes += raw.nbytes
        w.add_tensor(name, raw, raw_dtype=qtype)

    add("token_embd.weight", T.Q5_0, (VOCAB, DIM), 1)
    add("output.weight", T.Q8_0, (VOCAB, DIM), 2)
    w.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(DIM)).astype(np.float32))
    for i in range(LAYERS):
        for j, (role, (qtype, shape)) in enumerate(layer_tensors.items()):
            add(f"blk.{i}.{role}.weight", qtype, shape, 10 * i + j + 3)
        for role, n in (("attn_q", HEADS * HEAD_DIM), ("attn_k", KV_HEADS * HEAD_DIM), ("attn_v", KV_HEADS * HEAD_DIM)):
            w.add_tensor(f"blk.{i}.{role}.bias", (0.1 * rng.standard_normal(n)).astype(np.float32))
        for role in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{role}.weight", (1 + 0.1 * rng.standard_normal(DIM)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return matmul_bytes


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    folder = tmp_path_factory.mktemp("source_scheme")
    gguf_path = folder / "tiny.gguf"
    return gguf_path, write_tiny_gguf(gguf_path)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()


def test_source_scheme_holds_each_tensor_in_its_own_blocks(tiny: tuple[Path, int], tmp_path: Path) -> None:
    path, matmul_bytes = tiny
    art = open_artifact(convert(path, tmp_path / "art", progress=False))  # no -q: a GGUF keeps its own blocks
    cfg = art.config
    assert cfg.quantization.scheme == "source"
    assert Counter(cfg.quantization.formats.values()) == {"q5_0": 1 + 3 * LAYERS, "q4_k": 2 * LAYERS, "q6_k": LAYERS,
                                                          "q8": 1 + LAYERS}
    assert cfg.quantization.formats["model.layers.1.mlp.down_proj"] == "q6_k"
    weights = art.weights()
    stored = sum(t.nbytes for name, t in weights.items() if name.endswith(".qweight"))
    assert stored == matmul_bytes  # the GGUF's bytes, no more
    summary = format_summary({"lm_head": "q8", "model.layers.0.mlp.down_proj": "q6_k"},
                             {"lm_head": (VOCAB, DIM), "model.layers.0.mlp.down_proj": (DIM, FFN)})
    assert summary["q6_k"] == {"tensors": 1, "parameters": DIM * FFN, "bytes": storage_bytes("q6_k", (DIM, FFN)),
                               "bits_per_parameter": 6.5625}


@pytest.mark.skipif(native.load_library() is None, reason="no native kernel library on this machine")
def test_source_scheme_runs_natively_as_torch_runs_the_float_weights(tiny: tuple[Path, int], tmp_path: Path) -> None:
    path, _ = tiny
    source = Engine(open_artifact(convert(path, tmp_path / "source", progress=False)), threads=1)
    reference = Engine(open_artifact(convert(path, tmp_path / "f32", quantization="q0f32", progress=False)),
                       threads=1, runtime="torch")
    assert source.decode_path.startswith("native"), source.decode_path
    ids = [int(i) for i in np.random.default_rng(5).integers(0, VOCAB - 2, 24)]
    want = torch.as_tensor(np.asarray(reference.logits(ids)))
    prefill = torch.as_tensor(np.asarray(source.logits(ids)))
    decode = torch.as_tensor(np.asarray(source.logits(ids, step_from=1)))
    assert _relative(prefill, want) <= PREFILL_TOL[native.prefill_matmul() or "f32"]
    assert _relative(decode[1:], want[1:]) <= DECODE_TOL


def test_source_scheme_refuses_what_it_cannot_hold(tiny: tuple[Path, int], tmp_path: Path) -> None:
    from edgellm.convert.gguf_source import read_gguf

    source = read_gguf(tiny[0])
    with pytest.raises(UnsupportedQuantizationError, match="not a GGUF"):
        weight_formats(source.config, "source")  # no source to ask (an HF folder)
    with pytest.raises(UnsupportedQuantizationError, match="cannot hold exactly"):
        weight_formats(source.config, "source", exact_formats=lambda name: ())
    # a GGUF block type is quantized to (quant/kquant.py) where the source does not hold it, refused where it cannot fit
    assert weight_formats(source.config, "q8f16_1", {"model.layers.0.mlp.up_proj": "q6_k"},
                          source.exact_formats)["model.layers.0.mlp.up_proj"] == "q6_k"
    narrow = dataclasses.replace(source.config, vocab_size=source.config.vocab_size - 4)
    with pytest.raises(UnsupportedQuantizationError, match="whose blocks need N a multiple of 8"):
        weight_formats(narrow, "q8f16_1", {"model.embed_tokens": "q4_k"}, source.exact_formats)


# ---------------------------------------------------------------------------- the real model

TIE_MARGIN = 0.5  # logits closer than this may order either way (tests/test_native_decode.py)
REAL_ROW_TOL = 0.15  # a real model's int8-activation step vs float: measured 3-8% (tests/test_native_decode.py)


@pytest.mark.skipif(native.load_library() is None, reason="no native kernel library on this machine")
@pytest.mark.parametrize("prompt", ["def fibonacci(n):", "The capital of France is"])
def test_qwen_source_greedy_tokens_match_torch_on_the_dequantized_weights(prompt: str) -> None:
    """Qwen2.5-Coder-0.5B at its default scheme (source: Q5_0 / Q4_K / Q6_K / Q8_0 blocks, native decode steps)
    against torch's path on q0f32 (the same GGUF dequantized, float32 matmuls), teacher-forced: the greedy token is
    torch's top token except at near-ties (within TIE_MARGIN or twice the two paths' difference there)."""
    from edgellm.generation import GenerationParams

    mine = Engine.load("qwen2.5-coder-0.5b", progress=False, threads=1)
    assert mine.config.quantization.scheme == "source" and mine.decode_path.startswith("native"), mine.decode_path
    ids = mine.encode(prompt)
    tokens = mine.generate(ids, GenerationParams(max_tokens=16, temperature=0.0, ignore_eos=True)).token_ids
    steps = torch.as_tensor(np.asarray(mine.logits(ids + tokens[:-1], step_from=1)))[len(ids) - 1:]
    mine.close()
    ref = Engine.load("qwen2.5-coder-0.5b:q0f32", progress=False, threads=1, runtime="torch")
    rows = torch.as_tensor(np.asarray(ref.logits(ids + tokens[:-1])))[len(ids) - 1:]
    ref.close()
    for step, (token, row, got) in enumerate(zip(tokens, rows, steps)):
        assert _relative(got[None], row[None]) <= REAL_ROW_TOL, step
        best = int(row.argmax())
        gap, deviation = float(row[best] - row[token]), float((got - row).abs().max())
        assert token == best or gap <= max(TIE_MARGIN, 2 * deviation), (step, token, best, gap, deviation)


_TORCH_ONLY = """
import json, sys
import numpy as np, torch
from edgellm.artifact.reader import open_artifact
from edgellm.runtime.engine import Engine
src, ref = (Engine(open_artifact(p), threads=1, runtime="torch") for p in sys.argv[1:3])
ids = json.loads(sys.argv[3])
want, got = (torch.as_tensor(np.asarray(e.logits(ids))).double() for e in (ref, src))
print(json.dumps({"path": src.decode_path, "kernel": src.model.layers[0].mlp.down_proj.kernel.name,
                  "error": ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()}))
"""


def test_source_scheme_runs_on_torchs_path_without_the_library(tiny: tuple[Path, int], tmp_path: Path) -> None:
    """EDGELLM_KERNEL=torch (as where no library is built): the blocks dequantized slab by slab to bf16 for torch's
    bf16 GEMM, within the bf16 rounding's PREFILL_TOL."""
    import json
    import os
    import subprocess
    import sys

    src = convert(tiny[0], tmp_path / "source", progress=False)
    ref = convert(tiny[0], tmp_path / "f32", quantization="q0f32", progress=False)
    ids = [int(i) for i in np.random.default_rng(6).integers(0, VOCAB - 2, 16)]
    out = subprocess.run([sys.executable, "-c", _TORCH_ONLY, str(src), str(ref), json.dumps(ids)], check=True,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "EDGELLM_KERNEL": "torch"})
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["path"].startswith("torch") and got["kernel"] == "cpu-q6_k-dense-bf16", got
    assert got["error"] <= PREFILL_TOL["bf16"], got


def test_projections_sharing_one_block_format_run_on_torchs_runtime(tmp_path: Path) -> None:
    """q, k and v all Q5_0 (as in Qwen2.5-Coder's file): torch's runtime splits their outputs at each projection's own
    row count (a block format stores ROW_GROUP rows per stored row) and gives the float32 weights' logits."""
    shared = {**LAYER_TENSORS, "attn_v": (T.Q5_0, (KV_HEADS * HEAD_DIM, DIM))}
    path = tmp_path / "shared.gguf"
    write_tiny_gguf(path, shared)
    source = Engine(open_artifact(convert(path, tmp_path / "source", progress=False)), threads=1, runtime="torch")
    reference = Engine(open_artifact(convert(path, tmp_path / "f32", quantization="q0f32", progress=False)),
                       threads=1, runtime="torch")
    ids = [int(i) for i in np.random.default_rng(5).integers(0, VOCAB - 2, 24)]
    want = torch.as_tensor(np.asarray(reference.logits(ids)))
    got = torch.as_tensor(np.asarray(source.logits(ids)))
    assert _relative(got, want) <= PREFILL_TOL["bf16"]
