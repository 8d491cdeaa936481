"""Whether a source model is instruction-tuned, read from the names its metadata gives it (kept in manifest.json).

A chat template is no evidence either way: base SmolLM2 GGUFs carry one. The names are read in order, most
specific first, and the first one with a marker word decides: "instruct", "chat", "it" (Gemma's "-it"), "sft", ...
mean instruction-tuned, "base", "pt" (Gemma's "-pt"), "pretrained" a base model. A GGUF whose name metadata was
split by llama.cpp's converter (general.basename set) but has no general.finetune is a base model: the converter
puts a fine-tune's suffix ("Instruct", "it") there.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

from edgellm.artifact.manifest import Tuning

INSTRUCT_WORDS = frozenset({"instruct", "instruction", "chat", "it", "sft", "dpo", "rlhf", "orpo", "conversational"})
BASE_WORDS = frozenset({"base", "pt", "pretrained", "pretrain"})


def _words(text: str) -> set[str]:
    return set(re.split(r"[^0-9a-z]+", text.lower())) - {""}


def from_names(names: Iterable[tuple[str, object]]) -> Tuning | None:
    """The tuning the first (where, value) pair with a marker word names; None when no string value has one."""
    for where, value in names:
        if not isinstance(value, str):
            continue
        words = _words(value)
        if words & INSTRUCT_WORDS:
            return Tuning("instruct", f"{where} {value!r}")
        if words & BASE_WORDS:
            return Tuning("base", f"{where} {value!r}")
    return None


def gguf_tuning(field: Callable[[str], Any], file_name: str) -> Tuning:
    """From a GGUF's general.finetune, general.name, general.tags (not the `base_model:` links to the model it was
    tuned from) and its file name. (general.type says model / adapter, not how it was tuned.)"""
    finetune = field("general.finetune")
    tags = field("general.tags")
    tags = [t for t in tags if isinstance(t, str) and not t.startswith("base_model:")] if isinstance(tags, list) else []
    found = from_names([("general.finetune", finetune), ("general.name", field("general.name")),
                        *(("general.tags", t) for t in tags), ("file name", file_name)])
    if found is not None:
        return found
    basename = field("general.basename")
    if finetune is None and isinstance(basename, str):
        return Tuning("base", f"no general.finetune beside general.basename {basename!r}")
    told = f" (general.finetune {finetune!r})" if finetune is not None else ""
    return Tuning("unknown", f"no GGUF metadata or file name says instruct or base{told}")


def _last_part(name: object) -> object:
    """A hub id's or a path's last part: the model's name, not its owner's or the folders above it."""
    return name.rstrip("/").rsplit("/", 1)[-1] if isinstance(name, str) else name


def hf_tuning(folder_name: str, config: dict[str, Any], tokenizer_config: dict[str, Any]) -> Tuning:
    """From a Hugging Face folder's config.json `_name_or_path`, tokenizer_config.json `name_or_path` (the hub
    names they were saved from) and the folder's name."""
    found = from_names([("config.json _name_or_path", _last_part(config.get("_name_or_path"))),
                        ("tokenizer_config.json name_or_path", _last_part(tokenizer_config.get("name_or_path"))),
                        ("folder name", folder_name)])
    return found or Tuning("unknown", "no config name or folder name says instruct or base")
