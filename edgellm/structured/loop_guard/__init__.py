"""The loop guard: steers constrained JSON out of degenerate repetition (guard.py says how).

scanner (leaf: the JSON being written, the vocabulary's token texts) ← rule (the one interface a rule has) ←
periods, members (the rules) and copies (what the guard steered, both rules read it) ← guard (`LoopGuard`: feeds
the scanner, asks the rules in order). string_close steers a string the grammar will not let close yet (the periods
rule and the budget finish use it). The settings are `edgellm.loop_guard_config.LoopGuardConfig`.
"""

from edgellm.structured.loop_guard.guard import LoopGuard
from edgellm.structured.loop_guard.scanner import JSONScanner, TokenTexts, token_texts

__all__ = ["JSONScanner", "LoopGuard", "TokenTexts", "token_texts"]
