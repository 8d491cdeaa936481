"""The generation session and what it uses: tokens and logits only, below the Engine facade (runtime/).

generation_session (GenerationSession: the KV cache, the ids it holds, prefill with prefix reuse, the token loop,
context shift) · sampling · context (the window's shift) · power (pacing) · allocator · prompt_cache /
prompt_store (earlier prefixes, in memory and on disk) · speculative (prompt-lookup drafts, the acceptance rule) ·
speculative_draft (a draft model's drafts and the speculative-sampling rule).
Nothing here imports the tokenizer, the chat template or the Engine.
"""
