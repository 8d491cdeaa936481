"""A constrained request on the native runtime never imports torch, transformers or xgrammar's Python package
(their import cost seconds of the request's start; docs/structured-output.md): xgrammar's C++ core is driven
directly (structured/xgrammar_core.py) and the mask, loop guard and budget finish work on numpy logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import jsonschema
import pytest

from edgellm.structured.xgrammar_core import _TorchHidden

CHILD = r"""
import json, sys
from edgellm.generation import GenerationParams
from edgellm.response_format import ResponseFormat
from edgellm.runtime.engine import Engine

HEAVY = ("torch", "transformers", "xgrammar")
engine = Engine.load("smollm2-135m", threads=1, progress=False)
before = [m for m in HEAVY if m in sys.modules]
schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
formats = [ResponseFormat("json_object"), ResponseFormat("json_schema", schema=schema),
           ResponseFormat("regex", regex="(yes|no)")]
replies = []
for rf in formats:
    params = GenerationParams(max_tokens=40, temperature=0.0, response_format=rf, budget_finish=True)
    r = engine.chat([{"role": "user", "content": "Which city is the capital of France? Answer in JSON."}], params)
    replies.append({"text": r.text, "complete": r.complete})
print(json.dumps({"before": before, "after": [m for m in HEAVY if m in sys.modules], "replies": replies}))
"""


def test_a_constrained_request_loads_neither_torch_nor_xgrammars_package(smollm2_gguf: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["before"] == [], "the native runtime itself loaded these"
    assert out["after"] == []
    obj, schema_reply, regex_reply = out["replies"]
    assert isinstance(json.loads(obj["text"]), dict)  # 40 tokens with the budget finish: closed, parseable
    jsonschema.validate(json.loads(schema_reply["text"]),
                        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    assert regex_reply["text"] in ("yes", "no") and regex_reply["complete"]


def test_torch_is_hidden_from_the_loading_thread_only() -> None:
    """`run` loads xgrammar's bindings in a background thread while its model loads; a model on the torch runtime
    must still import torch meanwhile, so tvm_ffi's import hides torch from its own thread alone."""
    hidden = _TorchHidden(threading.get_ident())
    with pytest.raises(ImportError):
        hidden.find_spec("torch")
    with pytest.raises(ImportError):
        hidden.find_spec("torch.nn")
    assert hidden.find_spec("numpy") is None
    elsewhere: list[object] = []
    other = threading.Thread(target=lambda: elsewhere.append(hidden.find_spec("torch")))
    other.start()
    other.join()
    assert elsewhere == [None]  # the ordinary finders go on to find torch there
