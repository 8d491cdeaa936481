"""Each catalog model compiles to its own default scheme and carries its authors' sampling defaults."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from edgellm.artifact.config import ArtifactConfig, SamplingDefaults
from edgellm.catalog import CATALOG
from edgellm.quant.schemes import SCHEMES
from edgellm.resolve import resolve_model


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_defaults_name_real_schemes_and_sampling_fields(name: str) -> None:
    entry = CATALOG[name]
    assert entry.default_scheme in SCHEMES
    fields = {f.name for f in dataclasses.fields(SamplingDefaults)}
    assert set(entry.sampling) <= fields
    SamplingDefaults(**entry.sampling)  # the values have the right types


def test_a_plain_name_compiles_the_default_scheme_with_its_sampling(smollm2_gguf: Path) -> None:
    folder = resolve_model("smollm2-135m", progress=False)
    assert folder.name == "smollm2-135m-source"
    config = ArtifactConfig.read(folder)
    assert config.quantization.scheme == "source"  # the GGUF's own blocks: Q4_1 linears, a Q8_0 embedding
    assert sorted(set(config.quantization.formats.values())) == ["q4", "q8"]
    assert config.quantization.formats["model.embed_tokens"] == "q8"
    assert (config.sampling.temperature, config.sampling.top_p, config.sampling.repetition_penalty) == (0.1, 0.9, 1.12)
    assert resolve_model("smollm2-135m:q8f16_1", progress=False).name == "smollm2-135m-q8f16_1"  # explicit wins
