"""The float model a compression starts from: a Hugging Face folder, a .gguf file or a catalog name, in float32."""

from __future__ import annotations

import contextlib
import io
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase,
                          PreTrainedTokenizerFast)

from edgellm.errors import EdgeLLMError

class CompressError(EdgeLLMError):
    """A compression step that cannot run as asked (bad source, plan or checkpoint)."""


@dataclass
class FloatModel:
    """A float32 causal LM with its tokenizer, and where its tokenizer files come from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    origin: str

    def save(self, folder: Path) -> Path:
        """Write the model and tokenizer as a Hugging Face folder (written beside, then renamed into place)."""
        folder = Path(folder)
        tmp = folder.with_name(f".{folder.name}.partial")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp, safe_serialization=True)
        self.tokenizer.save_pretrained(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
        return folder


def load_float_model(source: str | Path) -> FloatModel:
    """Open ``source`` in float32: a Hugging Face folder, a .gguf file (dequantized), or a catalog name's GGUF."""
    from transformers.utils import logging as hf_logging

    from edgellm.progress import stderr_is_terminal

    if not stderr_is_terminal():  # transformers draws its loading bars into captured output too
        hf_logging.disable_progress_bar()
    path = Path(source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CompressError(f"{path} has no config.json: not a Hugging Face model folder")
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        # tokenizer.json as it is (AutoTokenizer may pick the family's class and re-read the vocabulary its way)
        tokenizer = (PreTrainedTokenizerFast.from_pretrained(str(path)) if (path / "tokenizer.json").is_file()
                     else AutoTokenizer.from_pretrained(str(path)))
        return FloatModel(model.eval(), tokenizer, str(path))
    if path.suffix != ".gguf":
        from edgellm.catalog import get_entry
        from edgellm.pull import pull

        get_entry(str(source))  # an unknown name is a one-line error naming the catalog
        path = pull(str(source), progress=False)
    if not path.is_file():
        raise CompressError(f"no such model file: {path}")
    quiet = contextlib.nullcontext() if stderr_is_terminal() else contextlib.redirect_stderr(io.StringIO())
    with quiet:  # the GGUF reader draws its own bar, whatever transformers' progress setting says
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # dequantized to float32 on load: a plain float model from here on (transformers would refuse to save it)
    setattr(model, "hf_quantizer", None)  # (nn.Module's typed setattr takes tensors and modules only)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return FloatModel(model.eval(), tokenizer, str(source))
