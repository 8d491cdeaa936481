"""scripts/random_shape_models.py on tiny shapes: the GGUF it writes is the transformers model it describes.

The published shapes (1.2-3.2 B parameters) are benchmarks, not tests; here a 2-layer Llama and Qwen2 shape with
a vocabulary larger than the borrowed tokenizer's, read back by gguf-py, by transformers' own GGUF loader (the
independent reference) and by edgellm's converter.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "random_shape_models.py"
VOCAB = 49152 + 64  # SmolLM2's 49152 tokens, padded by 64 unused entries


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("random_shape_models", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rsm() -> ModuleType:
    return _script()


def _tiny(rsm: ModuleType, arch: str):
    return rsm.Shape(arch, VOCAB, 64, 128, 2, 4, 2, 16, 10000.0, 1e-5, 256, "smollm2-135m")


def test_published_shapes_have_the_published_parameter_counts(rsm: ModuleType) -> None:
    counts = {name: sum(int(np.prod(d)) for _, d in rsm.parameter_shapes(shape)) for name, shape in rsm.SHAPES.items()}
    # the counts the model cards state (tied embeddings)
    assert counts == {"llama3.2-1b": 1_235_814_400, "llama3.2-3b": 3_212_749_824, "qwen2.5-1.5b": 1_543_714_304}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_shape_gguf_is_the_transformers_model(rsm: ModuleType, arch: str, tmp_path: Path,
                                                     smollm2_gguf: Path) -> None:
    import transformers

    from edgellm.artifact.reader import open_artifact
    from edgellm.convert.pipeline import convert
    from edgellm.runtime.engine import Engine

    shape = _tiny(rsm, arch)
    out = rsm.write_f16_gguf(shape, "tiny", smollm2_gguf, tmp_path / "tiny-f16.gguf", seed=1)
    reader = gguf.GGUFReader(out)
    params = dict(rsm.parameter_shapes(shape))
    assert sum(int(t.n_elements) for t in reader.tensors) == sum(int(np.prod(d)) for d in params.values())

    # scaled like a trained model: norms 1, biases 0, matrices normal(0, 0.02) in f16
    for t in reader.tensors:
        values = np.asarray(t.data, dtype=np.float64)
        if len(t.shape) == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            assert np.all(values == (0.0 if t.name.endswith(".bias") else 1.0)), t.name
        else:
            assert t.tensor_type == gguf.GGMLQuantizationType.F16
            assert abs(values.mean()) < 1e-3 and abs(values.std() - 0.02) < 0.002, t.name

    # the borrowed tokenizer: the source's tokens first, then unused padding up to the shape's rows
    source = gguf.GGUFReader(smollm2_gguf)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == len(types) == VOCAB
    assert tokens[:49152] == source.fields["tokenizer.ggml.tokens"].contents()
    assert tokens[-1] == f"[PAD{VOCAB - 1}]" and set(types[49152:]) == {int(gguf.TokenType.UNUSED)}

    # transformers' own GGUF loader reads the file as the architecture named, with every parameter it expects
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32)
    assert model.config.model_type == arch
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == params

    # and edgellm runs the same model from the same file
    ids = [5, 17, 300, 42, 1000, 7, 49151]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].double()
    engine = Engine(open_artifact(convert(out, tmp_path / "art", quantization="q0f32", progress=False)), threads=1)
    try:
        got = engine.logits(ids).double()
    finally:
        engine.close()
    assert got.shape == ref.shape == (len(ids), VOCAB)
    assert torch.allclose(got, ref, atol=1e-3 * float(ref.abs().max()), rtol=0)
