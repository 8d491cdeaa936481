"""The generation session on its own (no Engine, no tokenizer): the token loop against transformers, the
prefix it keeps between requests, and the end of its window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edgellm.artifact.config import SamplingDefaults
from edgellm.artifact.reader import open_artifact
from edgellm.convert.pipeline import convert
from edgellm.errors import ContextOverflowError
from edgellm.generation import ArrayLogitsProcessor, GenerationParams, GenerationStats
from edgellm.models.transformer import Transformer
from edgellm.session.generation_session import GenerationSession
from tests.support.tiny import VOCAB, make_tiny

CHUNK = 4
WINDOW = 48
GREEDY = GenerationParams(temperature=0.0)
PROMPT = torch.randint(0, VOCAB - 2, (10,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    root = tmp_path_factory.mktemp("session")
    ref = make_tiny(root / "hf", "qwen2", tied=False)
    return ref, convert(root / "hf", root / "art", quantization="q0f32", progress=False, prefill_chunk_size=CHUNK)


def new_session(folder: Path, window: int = WINDOW, sampling: SamplingDefaults | None = None) -> GenerationSession:
    artifact = open_artifact(folder)
    model = Transformer(artifact.config, artifact.weights()).eval()
    return GenerationSession(model, model.new_cache(window), context_window=window, prefill_chunk=CHUNK,
                             sampling=sampling or SamplingDefaults())


def take(session: GenerationSession, ids: list[int], n: int, params: GenerationParams = GREEDY,
         stats: GenerationStats | None = None, constraint: tuple[ArrayLogitsProcessor, ...] = ()) -> list[int]:
    """The first n tokens the session's loop yields for `ids` (fewer if the window ends first)."""
    steps = session.token_steps(ids, params, stats or GenerationStats(), constraint_processors=constraint)
    out = []
    for token, _ in steps:
        out.append(token)
        if len(out) == n:
            break
    steps.close()
    return out


def test_greedy_loop_matches_transformers(parts: tuple[torch.nn.Module, Path]) -> None:
    ref, folder = parts
    ours = take(new_session(folder), PROMPT, 20)
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ours == theirs


def test_the_default_repetition_penalty_is_for_free_text_only(parts: tuple[torch.nn.Module, Path]) -> None:
    _, folder = parts
    penalised = take(new_session(folder), PROMPT, 20, GenerationParams(temperature=0.0, repetition_penalty=50.0))
    plain = take(new_session(folder), PROMPT, 20)
    assert penalised != plain  # the penalty changes this model's greedy reply
    with_default = new_session(folder, sampling=SamplingDefaults(repetition_penalty=50.0))
    assert take(with_default, PROMPT, 20) == penalised  # free text: the model's default applies
    unchanged: tuple[ArrayLogitsProcessor, ...] = (lambda generated, logits: logits,)
    assert take(with_default, PROMPT, 20, constraint=unchanged) == plain  # under a constraint it does not
    asked = GenerationParams(temperature=0.0, repetition_penalty=50.0)
    assert take(new_session(folder), PROMPT, 20, asked, constraint=unchanged) == penalised  # one asked for does


def test_exact_reuse_keeps_only_whole_prefill_chunks(parts: tuple[torch.nn.Module, Path]) -> None:
    _, folder = parts
    session = new_session(folder)
    first = take(session, PROMPT, 6)
    # the cache holds the prompt and the decoded tokens but the last (sampled, never fed back)
    assert session.cached_ids == PROMPT + first[:-1] and session.prefilled == len(PROMPT)
    follow_up = PROMPT + first + [5, 6, 7]
    stats = GenerationStats()
    warm = take(session, follow_up, 8, stats=stats)
    assert stats.cached_tokens == len(PROMPT) - len(PROMPT) % CHUNK  # 8: never KV that decode steps wrote
    assert warm == take(new_session(folder), follow_up, 8)  # the same tokens as from an empty cache

    session.reset()
    assert session.cached_ids == []
    stats = GenerationStats()
    take(session, follow_up, 1, stats=stats)
    assert stats.cached_tokens == 0


def test_any_reuse_takes_every_matching_cached_token(parts: tuple[torch.nn.Module, Path]) -> None:
    _, folder = parts
    session = new_session(folder)
    first = take(session, PROMPT, 6)
    stats = GenerationStats()
    take(session, PROMPT + first + [5], 1, GenerationParams(temperature=0.0, prefix_reuse="any"), stats)
    assert stats.cached_tokens == len(PROMPT) + len(first) - 1


def test_the_loop_ends_with_the_window_and_logits_refuse_past_it(parts: tuple[torch.nn.Module, Path]) -> None:
    _, folder = parts
    session = new_session(folder, window=16)
    assert len(take(session, PROMPT, 100)) == 16 - len(PROMPT)  # prompt + output never exceed the window
    with pytest.raises(ContextOverflowError):
        session.logits(list(range(17)))
    rows = session.logits(PROMPT, step_from=CHUNK)
    assert rows.shape == (len(PROMPT), VOCAB) and session.cached_ids == PROMPT and session.prefilled == CHUNK
