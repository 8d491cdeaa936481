"""The loop guard's settings (the guard itself is structured/loop_guard/), a leaf beside the request types: a request
carries them, and building a request needs neither torch nor the structured package."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoopGuardConfig:
    """Thresholds and strength of the loop guard (the defaults never fire on ordinary JSON values)."""

    min_repeats: int = 3
    min_chars: int = 12
    max_period: int = 128  # SmolLM2 repeats whole sentences (85 characters in the corpus's k8s-configmap reply)
    max_array_period: int = 256  # a repeated array item is often a whole object
    max_digit_run: int = 24
    max_number_digits: int = 20  # a number with more digits in a row is a runaway (int64 has 19)
    min_array_chars: int = 32  # the items of an array must repeat over more text (e.g. [0, 0, 0, 0] is fine)
    penalty: float = 4.0
    base: float = 2.0
    close_after: int = 6
    close_episodes: int = 2  # a value that falls into a loop again after a step out of it is closed as well
    candidates: int = 16  # how many of the best allowed tokens are checked for continuing the loop
    window: int = 1024  # characters of the value examined (loops are found at its end)
    masked_repeats: int = 4  # a string whose period repeats only with its digit runs masked ("v1. v2. v3. ")
    member_repeats: int = 3  # members of an array/object that nearly repeat an earlier one before it is closed
    member_similarity: float = 0.8  # difflib ratio of two member signatures that counts as a near repeat
    member_chars: int = 64  # ... or as many characters of near-repeating members (large items repeat fewer times)

    def __post_init__(self) -> None:
        if self.min_repeats < 2 or self.min_chars < 2 or self.min_array_chars < 2 or self.max_period < 1 or self.max_digit_run < 2:
            raise ValueError("loop guard: min_repeats and min_chars must be >= 2, max_period >= 1, "
                             "max_digit_run >= 2")
        if self.penalty <= 0 or self.base < 1 or self.close_after < 1 or self.close_episodes < 1 \
                or self.candidates < 1:
            raise ValueError("loop guard: penalty must be > 0, base >= 1, close_after, close_episodes and "
                             "candidates >= 1")
        if self.max_number_digits < 2 or self.masked_repeats < 2 or self.member_repeats < 1 \
                or self.member_chars < 1 or not 0 < self.member_similarity <= 1:
            raise ValueError("loop guard: max_number_digits and masked_repeats must be >= 2, member_repeats and "
                             "member_chars >= 1, 0 < member_similarity <= 1")


DEFAULT_LOOP_GUARD = LoopGuardConfig()
