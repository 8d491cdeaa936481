"""Instruction tuning recorded in manifest.json: read from the source's names (GGUF general.* metadata, the file
name, a Hugging Face folder's names), never from a chat template; `info` shows it, `run` and `chat` note a base
model driven through its chat template on stderr.

The catalog rows copy the general.* metadata of the three catalog GGUFs (read with gguf-py from the pulled
files); what each model is comes from its model card: SmolLM2-135M-Instruct and Qwen2.5-Coder-0.5B-Instruct are
instruction-tuned, the catalog's Gemma 3 270M file is the base (pre-trained) model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import pytest

from edgellm.artifact.reader import open_artifact
from edgellm.cli import main
from edgellm.convert.gguf_source import read_gguf
from edgellm.convert.hf_source import read_hf
from edgellm.convert.pipeline import convert
from edgellm.errors import ArtifactError
from tests.support.gguf_writer import add_placeholder_vocab, add_shape
from tests.support.tiny import VOCAB, make_tiny
from tests.support.tiny_chat import TEMPLATE

_SMOLLM2_TEMPLATE = "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"


def _write_gguf(path: Path, meta: dict[str, Any], *, template: str | None = None) -> Path:
    """A tiny random llama GGUF (a transformers model's weights) with the general.* fields of ``meta``."""
    model = make_tiny(path.parent / f"{path.stem}-hf", "llama", tied=True)
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    adders = {"general.name": w.add_name, "general.finetune": w.add_finetune, "general.basename": w.add_basename,
              "general.size_label": w.add_size_label, "general.type": w.add_type, "general.tags": w.add_tags}
    for key, value in meta.items():
        adders[key](value)
    add_shape(w, cfg)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    add_placeholder_vocab(w, VOCAB)
    if template is not None:
        w.add_chat_template(template)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        stem = name.removesuffix(".weight")
        parts = stem.split(".")
        gguf_name = names[stem] if stem in names else f"blk.{parts[2]}.{names['.'.join(parts[3:])]}"
        w.add_tensor(f"{gguf_name}.weight", tensor.float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# (file name, general.* metadata, chat template?, kind, the metadata that decides)
GGUF_CASES = [
    pytest.param("SmolLM2-135M-Instruct.Q4_1.gguf",
                 {"general.type": "model", "general.name": "Smollm2 135M 8k Lc100K Mix1 Ep2",
                  "general.finetune": "8k-lc100k-mix1-ep2", "general.basename": "smollm2", "general.size_label": "135M"},
                 True, "instruct", "file name", id="catalog-smollm2-135m-instruct"),
    pytest.param("Qwen2.5-Coder-0.5B-Instruct.gguf",
                 {"general.type": "model", "general.name": "Qwen2.5 Coder 0.5B Instruct AWQ",
                  "general.finetune": "Instruct-AWQ", "general.basename": "Qwen2.5-Coder", "general.size_label": "0.5B"},
                 True, "instruct", "general.finetune", id="catalog-qwen2.5-coder-0.5b-instruct"),
    pytest.param("gemma-3-270m-q4_k_m.gguf",
                 {"general.type": "model", "general.name": "Gemma 3 270m", "general.basename": "gemma-3",
                  "general.size_label": "270M", "general.tags": ["gemma3", "gemma", "google", "text-generation"]},
                 False, "base", "general.basename", id="catalog-gemma3-270m-base"),
    pytest.param("gemma-3-270m-it-Q8_0.gguf",
                 {"general.name": "Gemma 3 270m It", "general.finetune": "it", "general.basename": "gemma-3"},
                 True, "instruct", "general.finetune", id="gemma3-270m-it"),
    pytest.param("SmolLM2-135M.Q8_0.gguf",  # a base model that carries a chat template
                 {"general.name": "SmolLM2 135M", "general.basename": "SmolLM2", "general.size_label": "135M"},
                 True, "base", "general.basename", id="base-with-chat-template"),
    pytest.param("gemma-2-2b-pt.gguf", {"general.name": "Gemma 2 2b Pt", "general.finetune": "pt"},
                 False, "base", "general.finetune", id="gemma-pt"),
    pytest.param("model.gguf",  # a fine-tune's link to its base model is not a base marker
                 {"general.name": "tuned", "general.tags": ["base_model:finetune:HuggingFaceTB/SmolLM2-135M"]},
                 True, "unknown", "no GGUF metadata", id="base-model-link-tag"),
    pytest.param("model.gguf", {"general.name": "mymodel"}, True, "unknown", "no GGUF metadata", id="old-naming"),
    pytest.param("model.gguf", {"general.finetune": "8k-lc100k-mix1-ep2", "general.basename": "smollm2"}, True,
                 "unknown", "general.finetune '8k-lc100k-mix1-ep2'", id="unreadable-finetune"),
]


@pytest.mark.parametrize("file_name,meta,templated,kind,source", GGUF_CASES)
def test_gguf_metadata_decides_tuning(tmp_path: Path, file_name: str, meta: dict[str, Any], templated: bool,
                                      kind: str, source: str) -> None:
    src = read_gguf(_write_gguf(tmp_path / file_name, meta, template=_SMOLLM2_TEMPLATE if templated else None))
    assert (src.chat_template is not None) == templated
    assert src.tuning.kind == kind
    assert source in src.tuning.source


def _hf_folder(folder: Path, config_name: str | None = None) -> Path:
    make_tiny(folder, "llama", tied=True)
    if config_name is not None:  # what hub config.json files carry (transformers 5 no longer writes it)
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"_name_or_path": config_name}))
    return folder


def test_hf_folder_names_decide_tuning(tmp_path: Path) -> None:
    instruct = read_hf(_hf_folder(tmp_path / "SmolLM2-135M-Instruct")).tuning
    assert (instruct.kind, instruct.source) == ("instruct", "folder name 'SmolLM2-135M-Instruct'")
    hub = read_hf(_hf_folder(tmp_path / "weights", "HuggingFaceTB/SmolLM2-135M-Instruct")).tuning
    assert (hub.kind, hub.source) == ("instruct", "config.json _name_or_path 'SmolLM2-135M-Instruct'")
    base = read_hf(_hf_folder(tmp_path / "download", "google/gemma-3-270m-pt")).tuning
    assert base.kind == "base"
    path_only = read_hf(_hf_folder(tmp_path / "model", "/data/pt_runs/model")).tuning  # folders above don't count
    assert path_only.kind == "unknown"


def test_manifest_records_tuning_and_old_manifests_still_load(tmp_path: Path) -> None:
    art = convert(_hf_folder(tmp_path / "tiny-instruct"), tmp_path / "art", quantization="q0f32", progress=False)
    raw = json.loads((art / "manifest.json").read_text())
    assert raw["tuning"] == {"kind": "instruct", "source": "folder name 'tiny-instruct'"}
    assert open_artifact(art, sha256=True).manifest.tuning.kind == "instruct"
    del raw["tuning"]  # a manifest written before the field
    (art / "manifest.json").write_text(json.dumps(raw))
    old = open_artifact(art, sha256=True).manifest.tuning
    assert old.kind == "unknown" and "not recorded" in old.source
    (art / "manifest.json").write_text(json.dumps(raw | {"tuning": {"kind": "chatty", "source": "x"}}))
    with pytest.raises(ArtifactError, match="manifest.json is malformed: tuning must be"):
        open_artifact(art)


@pytest.fixture(scope="module")
def templated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny artifacts with a chat template: a base model's (by its folder name) and an instruct model's."""
    root = tmp_path_factory.mktemp("tuning-cli")
    out = {}
    for name in ("tiny-base", "tiny-instruct"):
        _hf_folder(root / name)
        (root / name / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
        out[name] = convert(root / name, root / f"{name}-art", quantization="q0f32", progress=False)
    return out


def test_info_shows_tuning(templated: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", str(templated["tiny-base"]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tuning"] == {"kind": "base", "source": "folder name 'tiny-base'"}
    assert main(["info", str(templated["tiny-instruct"])]) == 0
    rows = {line.split()[0]: line.split(None, 1)[1] for line in capsys.readouterr().out.splitlines()}
    assert rows["tuning"] == "instruct (folder name 'tiny-instruct')"


def test_run_notes_a_base_model_through_its_template_on_stderr_only(
        templated: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    note = "is a base model, not instruction-tuned (folder name 'tiny-base')"
    assert main(["run", str(templated["tiny-base"]), "t1 t2", "-n", "2", "--threads", "1", "--seed", "0"]) == 0
    out, err = capsys.readouterr()
    assert err.count(note) == 1 and "base model" not in out
    for args in ([str(templated["tiny-base"]), "--raw"], [str(templated["tiny-instruct"])]):
        assert main(["run", *args, "t1 t2", "-n", "2", "--threads", "1", "--seed", "0"]) == 0
        assert "base model" not in capsys.readouterr().err


def test_chat_notes_a_base_model(templated: dict[str, Path]) -> None:
    base, instruct = (subprocess.run([sys.executable, "-m", "edgellm.cli", "chat", str(templated[n]), "--threads", "1"],
                                     capture_output=True, text=True, input="/exit\n", timeout=300,
                                     env={**os.environ, "EDGELLM_DEBUG": ""})
                      for n in ("tiny-base", "tiny-instruct"))
    assert base.returncode == 0 and instruct.returncode == 0, base.stderr + instruct.stderr
    assert base.stderr.count("is a base model, not instruction-tuned") == 1
    assert "base model" not in base.stdout + instruct.stdout + instruct.stderr

