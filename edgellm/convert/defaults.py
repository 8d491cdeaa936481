"""What a compiled artifact gets where the user does not say: the cap on its context window and its prefill chunk
(the converter writes them; the memory planner predicts an uncompiled GGUF with them). Needs no torch."""

DEFAULT_CONTEXT_WINDOW = 4096
DEFAULT_PREFILL_CHUNK = 512
