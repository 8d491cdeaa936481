"""A constrained request on the native runtime never imports torch, transformers or xgrammar's Python package
(their import cost seconds of the request's start; docs/structured-output.md): xgrammar's C++ core is driven
directly (structured/xgrammar_core.py) and the mask, loop guard and budget finish work on numpy logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema

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
