"""`edgellm compress`: structured pruning, distillation to heal it, and quantization-aware tuning.

Each step reads and writes a Hugging Face-format folder (safetensors + config.json + tokenizer), so the result goes
through `edgellm convert` and the usual gates (`eval quality`, `eval task`, `select`) like any other source.
"""
