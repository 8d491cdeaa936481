"""xgrammar's C++ core (tokenizer info, grammar compiler, compiled grammar, matcher), reached through its tvm_ffi
bindings without the `xgrammar` Python package, whose import pulls torch and transformers (seconds of a
constrained request's start; docs/structured-output.md). Masks are filled into plain numpy int32 words.

The handles are xgrammar's own objects: the methods named in the protocols below are its bindings' (xgrammar
0.2's `xgrammar/tvm_ffi_binding`), called with every argument positionally, as its Python wrappers call them.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

# Type keys of the bindings' classes (registered by the C++ library on load).
_TYPE_PREFIX = "xgrammar.tvm_ffi_binding."
_CLASSES = ("TokenizerInfo", "Grammar", "GrammarCompiler", "CompiledGrammar", "GrammarMatcher")
VOCAB_TYPES = {"RAW": 0, "BYTE_FALLBACK": 1, "BYTE_LEVEL": 2}  # xgrammar.VocabType's values


class TokenizerInfo(Protocol):
    def serialize_json(self) -> str: ...

    def vocab_size(self) -> int: ...

    def stop_token_ids(self) -> list[int]: ...


class Grammar(Protocol):
    def to_string(self) -> str: ...


class CompiledGrammar(Protocol):
    def memory_size_bytes(self) -> int: ...

    def serialize_json(self) -> str: ...


class Compiler(Protocol):
    def compile_json_schema(self, schema: str, any_whitespace: bool, indent: int | None,
                            separators: tuple[str, str] | None, strict_mode: bool, max_whitespace_cnt: int | None,
                            any_order: bool, /) -> CompiledGrammar: ...

    def compile_regex(self, regex: str, /) -> CompiledGrammar: ...

    def compile_grammar_ebnf(self, grammar: Grammar, /) -> CompiledGrammar: ...


class MatcherHandle(Protocol):
    def accept_token(self, token: int, debug_print: bool, /) -> bool: ...

    def accept_string(self, text: str, debug_print: bool, /) -> bool: ...

    def fill_next_token_bitmask(self, bitmask: object, index: int, debug_print: bool, /) -> bool: ...

    def is_terminated(self) -> bool: ...

    def is_completed(self) -> bool: ...

    def rollback(self, tokens: int, /) -> None: ...

    def fork(self) -> MatcherHandle: ...

    def find_jump_forward_string(self) -> str: ...


class _FromDLPack(Protocol):
    def __call__(self, ext_tensor: np.ndarray) -> object: ...


@dataclass(frozen=True)
class Core:
    """The loaded bindings: constructors and static functions of xgrammar's C++ classes."""

    version: str  # the xgrammar distribution's version
    serialization_version: str
    _classes: dict[str, type]
    _from_dlpack: _FromDLPack

    def tokenizer_info(self, encoded_vocab: list[str], vocab_type: str, vocab_size: int, stop_token_ids: list[int],
                       add_prefix_space: bool) -> TokenizerInfo:
        info: TokenizerInfo = self._classes["TokenizerInfo"](encoded_vocab, VOCAB_TYPES[vocab_type], vocab_size,
                                                            stop_token_ids, add_prefix_space)
        return info

    def deserialize_tokenizer_info(self, text: str) -> TokenizerInfo:
        """A TokenizerInfo from its `serialize_json` text (raises RuntimeError on text that is not one)."""
        info: TokenizerInfo = self._classes["TokenizerInfo"].deserialize_json(text)  # type: ignore[attr-defined]
        return info

    def detect_metadata(self, tokenizer_json: str) -> tuple[str, bool]:
        """(vocab type name, add_prefix_space) that xgrammar reads from a `tokenizers` JSON spec's decoder."""
        import json

        meta = json.loads(str(self._classes["TokenizerInfo"]._detect_metadata_from_hf(tokenizer_json)))  # type: ignore[attr-defined]
        names = {v: k for k, v in VOCAB_TYPES.items()}
        return names[int(meta["vocab_type"])], bool(meta["add_prefix_space"])

    def compiler(self, info: TokenizerInfo, threads: int) -> Compiler:
        """A compiler without xgrammar's own cache (edgellm's GrammarCache is the one cache)."""
        compiler: Compiler = self._classes["GrammarCompiler"](info, max(1, threads), False, -1, False)
        return compiler

    def grammar_from_ebnf(self, ebnf: str, root: str = "root") -> Grammar:
        grammar: Grammar = self._classes["Grammar"].from_ebnf(ebnf, root)  # type: ignore[attr-defined]
        return grammar

    def deserialize_compiled(self, text: str, info: TokenizerInfo) -> CompiledGrammar:
        compiled: CompiledGrammar = self._classes["CompiledGrammar"].deserialize_json(text, info)  # type: ignore[attr-defined]
        return compiled

    def matcher(self, compiled: CompiledGrammar, stop_token_ids: list[int] | None = None) -> Matcher:
        handle: MatcherHandle = self._classes["GrammarMatcher"](compiled, stop_token_ids, False, -1, None)
        return Matcher(handle, self)

    def dlpack(self, words: np.ndarray) -> object:
        """A tvm_ffi view of a C-contiguous int32 numpy array (the matcher writes through it)."""
        return self._from_dlpack(words)


class Matcher:
    """A grammar matcher: xgrammar's GrammarMatcher over numpy bitmask words."""

    def __init__(self, handle: MatcherHandle, core: Core) -> None:
        self._handle = handle
        self._core = core

    def accept_token(self, token: int) -> bool:
        return bool(self._handle.accept_token(int(token), False))

    def accept_string(self, text: str) -> bool:
        return bool(self._handle.accept_string(text, False))

    def fill_next_token_bitmask(self, words: np.ndarray) -> None:
        """Write the next token's mask into `words` (int32, (ceil(V/32),), bit i of word w: token 32w+i allowed)."""
        if words.dtype != np.int32 or words.ndim != 1 or not words.flags.c_contiguous:
            raise ValueError("the bitmask must be a C-contiguous 1-D int32 array")
        self._handle.fill_next_token_bitmask(self._core.dlpack(words[None, :]), 0, False)

    def is_terminated(self) -> bool:
        return bool(self._handle.is_terminated())

    def is_completed(self) -> bool:
        return bool(self._handle.is_completed())

    def rollback(self, tokens: int = 1) -> None:
        self._handle.rollback(tokens)

    def fork(self) -> Matcher:
        return Matcher(self._handle.fork(), self._core)

    def forced_text(self) -> str:
        """The longest text every continuation of the output starts with (xgrammar's jump-forward string: whole
        UTF-8 characters only; "" where there is a choice)."""
        return str(self._handle.find_jump_forward_string())


def bitmask_words(vocab_size: int) -> np.ndarray:
    """A mask buffer for `vocab_size` tokens, every token allowed."""
    return np.full((vocab_size + 31) // 32, -1, dtype=np.int32)


def apply_bitmask(logits: np.ndarray, words: np.ndarray, vocab_size: int) -> None:
    """Set to -inf, in place, the logits of tokens whose bit is clear, and every logit at or past `vocab_size`."""
    allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:logits.shape[-1]].astype(bool)
    allowed[vocab_size:] = False
    logits[~allowed] = -np.inf


class _TorchHidden:
    """A meta-path finder that makes `import torch` fail in one thread only (the one importing tvm_ffi): another
    thread (a model loading meanwhile on the torch runtime) imports torch as usual."""

    def __init__(self, thread: int) -> None:
        self.thread = thread

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.partition(".")[0] == "torch" and threading.get_ident() == self.thread:
            raise ModuleNotFoundError("torch is hidden while tvm_ffi imports", name=name)
        return None


def _import_tvm_ffi() -> None:
    """Import tvm_ffi; unless torch is loaded already, with torch hidden from this thread (tvm_ffi imports it only
    to speed up conversions of torch tensors, which edgellm never passes), so that a constrained request does not
    load it."""
    if "tvm_ffi" in sys.modules or "torch" in sys.modules:
        import tvm_ffi  # noqa: F401
        return
    hidden = _TorchHidden(threading.get_ident())
    sys.meta_path.insert(0, hidden)
    try:
        import tvm_ffi  # noqa: F401
    finally:
        sys.meta_path.remove(hidden)


_core_lock = threading.Lock()


def core() -> Core:
    """Load xgrammar's bindings once per process (its Python package is left alone unless imported already); a
    thread that asks while another loads them waits for that one (`run` starts loading them as its model loads)."""
    with _core_lock:
        return _load_core()


@functools.lru_cache(maxsize=1)
def _load_core() -> Core:
    import importlib.metadata  # here: its import (email, csv, ...) is part of a constrained request's start

    _import_tvm_ffi()
    import tvm_ffi
    from tvm_ffi.libinfo import load_lib_module

    spec = importlib.util.find_spec("xgrammar")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("xgrammar is not installed (structured output needs it)")
    classes: dict[str, type] = {}
    bound = sys.modules.get(_TYPE_PREFIX.rstrip(".") + "._ffi_api")
    if bound is not None:  # xgrammar's package is loaded: its registered classes are the ones tvm_ffi returns
        classes = {name: getattr(bound, name) for name in _CLASSES}
    else:
        load_lib_module("xgrammar", "xgrammar_bindings",
                        extra_lib_paths=[Path(p) for p in spec.submodule_search_locations])
        for name in _CLASSES:
            classes[name] = tvm_ffi.register_object(_TYPE_PREFIX + name)(
                type(name, (tvm_ffi.Object,), {"__slots__": ()}))
    version_func = tvm_ffi.get_global_func(_TYPE_PREFIX + "config.get_serialization_version")
    return Core(importlib.metadata.version("xgrammar"), str(version_func()), classes, tvm_ffi.from_dlpack)

