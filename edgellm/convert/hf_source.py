"""Read a Hugging Face model folder (config.json + *.safetensors + tokenizer files) as a SourceModel."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import safe_open

from edgellm.artifact.config import SamplingDefaults, SourceInfo, TokenizerConfig
from edgellm.convert.source import SourceModel, tensor_loader
from edgellm.convert.tuning import hf_tuning
from edgellm.errors import UnsupportedModelError
from edgellm.families.registry import family_for_hf

_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<|end|>", "</s>")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UnsupportedModelError(f"{path} is not valid JSON: {exc}") from None


def _token_id(tokenizer: dict[str, Any], token: Any) -> int | None:
    """Look a special token (string or {"content": ...}) up in tokenizer.json."""
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    for added in tokenizer.get("added_tokens", []):
        if added.get("content") == token:
            return int(added["id"])
    vocab = (tokenizer.get("model") or {}).get("vocab") or {}
    return vocab.get(token) if isinstance(vocab, dict) else None


def _tokenizer_config(folder: Path, tokenizer: dict[str, Any], model_raw: dict[str, Any]) -> TokenizerConfig:
    tok_cfg = _read_json(folder / "tokenizer_config.json")
    gen_cfg = _read_json(folder / "generation_config.json")
    bos = _token_id(tokenizer, tok_cfg.get("bos_token"))
    eos = _token_id(tokenizer, tok_cfg.get("eos_token"))
    bos = bos if bos is not None else gen_cfg.get("bos_token_id", model_raw.get("bos_token_id"))
    if eos is None:
        eos = gen_cfg.get("eos_token_id", model_raw.get("eos_token_id"))
        eos = eos[0] if isinstance(eos, list) else eos
    stops = {eos} if eos is not None else set()
    gen_eos = gen_cfg.get("eos_token_id")
    stops.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    stops.update(i for i in (_token_id(tokenizer, t) for t in _END_OF_TURN) if i is not None)
    return TokenizerConfig(
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=_token_id(tokenizer, tok_cfg.get("pad_token")),
        add_bos_token=bool(tok_cfg.get("add_bos_token", False)),
        stop_token_ids=tuple(sorted(stops)),
    )


def _chat_template(folder: Path) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = _read_json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def _sampling(folder: Path) -> SamplingDefaults:
    gen = _read_json(folder / "generation_config.json")
    base = SamplingDefaults()
    if not gen.get("do_sample", True):
        return SamplingDefaults(temperature=0.0, top_p=1.0)
    return SamplingDefaults(
        temperature=float(gen.get("temperature", base.temperature)),
        top_p=float(gen.get("top_p", base.top_p)),
        top_k=int(gen.get("top_k", base.top_k) or 0),
        repetition_penalty=float(gen.get("repetition_penalty", base.repetition_penalty)),
    )


def read_hf(folder: Path) -> SourceModel:
    """Open a Hugging Face folder; only safetensors weights are accepted (pickled weights are never loaded)."""
    raw = _read_json(folder / "config.json")
    if not raw:
        raise UnsupportedModelError(f"{folder} has no config.json: not a Hugging Face model folder")
    family = family_for_hf(raw.get("architectures") or [])
    try:
        config = family.config_from_hf(raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise UnsupportedModelError(f"{folder}/config.json is incomplete or malformed: {exc!r}") from None
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        pickled = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = f" (found {pickled[0]}; pickled weights are never loaded, convert them to safetensors)" if pickled else ""
        raise UnsupportedModelError(f"{folder} has no *.safetensors weights{hint}")
    tokenizer_path = folder / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise UnsupportedModelError(f"{folder} has no tokenizer.json (only fast tokenizers are supported)")
    tokenizer_json = tokenizer_path.read_text(encoding="utf-8")

    where: dict[str, Path] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as fh:
            for key in fh.keys():
                where[key] = shard
    if config.tie_word_embeddings is False and "lm_head.weight" not in where:
        raise UnsupportedModelError(f"{folder}: config says untied embeddings but lm_head.weight is missing")

    def read(name: str):
        with safe_open(str(where[name]), framework="pt") as fh:
            return fh.get_tensor(name).float()

    names = family.tensor_names(config)
    load = tensor_loader(str(folder), family.hf_sources(config), set(where), read)

    return SourceModel(
        info=SourceInfo(kind="hf", name=folder.name),
        config=config,
        tokenizer_json=tokenizer_json,
        tokenizer=_tokenizer_config(folder, json.loads(tokenizer_json), raw),
        chat_template=_chat_template(folder),
        sampling=_sampling(folder),
        tensor_names=tuple(names),
        load_tensor=load,
        tuning=hf_tuning(folder.name, raw, _read_json(folder / "tokenizer_config.json")),
    )
