"""Speculative decoding by prompt lookup (session/speculative.py): drafts from n-gram matches, greedy output identical
to plain decoding (tiny native model and the real SmolLM2), the positions after a refused draft rolled back, and the
acceptance rule's distribution (chi-square against the model's own next-token distribution)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from edgellm.artifact.reader import open_artifact
from edgellm.convert.pipeline import convert
from edgellm.errors import EdgeLLMError
from edgellm.generation import GenerationParams
from edgellm.session import generation_session
from edgellm.runtime.engine import Engine
from edgellm.session.sampling import filter_logits
from edgellm.models.native_model import NativeModel
from edgellm.session.speculative import MAX_DRAFT, START_DRAFT, LookupDrafter, ReplyMemory, accept_draft
from tests.kernels.test_native_decode import _make_model

pytest.importorskip("transformers")

rng = np.random.default_rng(11)
SPAN = rng.integers(0, 250, 12).tolist()
# copy-like prompts: a span that comes back, so the output's n-grams find drafts in the prompt
PROMPTS = [SPAN + rng.integers(0, 250, 5).tolist() + SPAN[:4], rng.integers(0, 250, 30).tolist(), SPAN * 3]


def greedy(spec: str | None, n: int = 24) -> GenerationParams:
    return GenerationParams(temperature=0.0, max_tokens=n, ignore_eos=True, top_logprobs=0, speculative=spec)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    root = tmp_path_factory.mktemp("speculative")
    _make_model(root / "hf", "qwen2", tied=False)
    return Engine(open_artifact(convert(root / "hf", root / "art", quantization="q4f16_1", progress=False)),
                  threads=1)


def run(engine: Engine, ids: list[int], params: GenerationParams) -> tuple[list[tuple[int, float]], object]:
    engine.reset()
    result = engine.generate(ids, params)
    return [(lp.token_id, lp.logprob) for lp in result.logprobs], result.stats


def test_drafts_follow_the_longest_matching_ngram() -> None:
    d = LookupDrafter([5, 6, 7, 8, 9, 1, 7, 2, 3, 6, 7], max_ngram=3, max_draft=3)
    d.length = 3
    assert d.propose(10) == [8, 9, 1]  # (6, 7) matched at its earlier place, not the later lone 7
    d.extend([8])
    assert d.propose(10) == [9, 1, 7]  # (6, 7, 8)
    assert d.propose(2) == [9, 1]  # capped by the room left
    assert LookupDrafter([1, 2, 3]).propose(5) == []  # nothing came before
    d = LookupDrafter([4, 4, 4])
    assert d.propose(5) == [4, 4]  # (4, 4) is followed by 4, and the draft's own end (4, 4) again: a run goes on


def test_reply_memory_keeps_the_latest_follower_of_each_ngram_within_its_bound() -> None:
    memory = ReplyMemory(max_ngram=3, entries=100)
    memory.add([1, 2, 3, 4])
    assert memory.match([9, 2, 3]) == (2, 4, True) and memory.match([1, 2, 3]) == (3, 4, True)
    assert memory.match([3]) == (1, 4, True) and memory.match([9, 8]) is None and memory.match([]) is None
    memory.add([5, 2, 3, 7])
    assert memory.match([9, 2, 3]) == (2, 7, False)  # the latest reply's follower, no longer the only one
    assert memory.match([1, 2, 3]) == (3, 4, True)  # a longer n-gram only the first reply held
    memory.add([2, 3, 4])
    assert memory.match([2, 3]) == (2, 4, False)  # once two followers, never consistent again
    assert len(memory) == 6 + 3  # (1) (2) (3) (1,2) (2,3) (1,2,3), then (5) (5,2) (5,2,3)
    small = ReplyMemory(max_ngram=1, entries=2)
    small.add([1, 2, 3, 4])  # (1)→2, (2)→3, (3)→4: the oldest goes
    assert len(small) == 2 and small.match([1]) is None and small.match([3]) == (1, 4, True)
    small.add([2, 9])  # seen again: now the newest, so (3) goes next
    small.add([7, 8])
    assert small.match([2]) == (1, 9, False) and small.match([3]) is None and small.match([7]) == (1, 8, True)


def test_drafts_come_from_the_memory_where_it_matches_longer_and_consistently() -> None:
    memory = ReplyMemory()
    memory.add([50, 51, 52, 53, 54, 55])
    d = LookupDrafter([1, 2, 3, 50, 51], memory=memory)
    d.length = 4
    assert d.propose(9) == [52, 53, 54, 55]  # the history never had (51): the memory's reply goes on
    d = LookupDrafter([51, 60, 61, 50, 51], memory=memory)
    d.length = 3
    assert d.propose(9) == [52, 53, 54]  # the memory's (50, 51) beats the history's (51) → 60
    d = LookupDrafter([50, 51, 60, 61, 50, 51], memory=memory)
    d.length = 2
    assert d.propose(9) == [60, 61]  # as long a match in the history: the history's
    memory.add([50, 51, 70])
    d = LookupDrafter([51, 60, 61, 50, 51], memory=memory)
    d.length = 1
    assert d.propose(9) == [60]  # replies followed (50, 51) two ways: the history's shorter match
    d = LookupDrafter([7, 8, 9], memory=memory)
    d.extend([10, 11])
    d.remember()  # the tokens appended since the prompt
    assert memory.match([10]) == (1, 11, True) and memory.match([8]) is None


@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_greedy_speculative_output_is_plain_greedy_output(tiny: Engine, prompt: int) -> None:
    ids = PROMPTS[prompt]
    plain, _ = run(tiny, ids, greedy(None))
    spec, stats = run(tiny, ids, greedy("lookup"))
    assert spec == plain  # tokens and their log-probabilities, bit for bit
    assert stats.draft_tokens > 0


def test_lookup_replies_fill_the_reply_memory_and_change_no_output(tiny: Engine,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup request's reply joins the engine's reply memory (a plain one's does not), and a later request drafted
    from it is still plain greedy output."""
    monkeypatch.setattr(tiny.session, "reply_memory", ReplyMemory())
    plain, _ = run(tiny, PROMPTS[1], greedy(None, 40))
    assert len(tiny.session.reply_memory) == 0
    first, _ = run(tiny, PROMPTS[1], greedy("lookup", 40))
    filled = len(tiny.session.reply_memory)
    assert filled > 0
    second, _ = run(tiny, PROMPTS[1], greedy("lookup", 40))
    other, _ = run(tiny, PROMPTS[0], greedy("lookup", 40))
    assert first == second == plain and other == run(tiny, PROMPTS[0], greedy(None, 40))[0]
    assert len(tiny.session.reply_memory) > filled


def test_positions_after_a_refused_draft_are_rolled_back(tiny: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A verifier that feeds the whole draft at once (as a batched forward does) writes keys/values after the
    refused token: they must not count as cached."""

    def all_at_once(model, ids, start, cache):
        return iter([model.run([int(t)], start + i, cache) for i, t in enumerate(ids)])

    monkeypatch.setattr(generation_session, "step_rows", all_at_once)
    refused = 0
    for ids in PROMPTS:
        plain, _ = run(tiny, ids, greedy(None))
        spec, stats = run(tiny, ids, greedy("lookup"))
        assert spec == plain
        refused += stats.draft_tokens - stats.accepted_tokens
        assert len(tiny.session.cached_ids) == len(ids) + len(spec) - 1  # the last token is never fed
    assert refused > 0


@pytest.mark.parametrize("max_batch", [16, 2])
def test_drafts_are_verified_in_batched_steps(tiny: Engine, monkeypatch: pytest.MonkeyPatch, max_batch: int) -> None:
    """On the native model each fed token and its draft go through NativeModel.decode_batch: rows of the session's
    cache at consecutive positions, at most max_batch per call (more rows: the next call only once the caller reads
    past the first's)."""
    model = tiny.session.model
    assert isinstance(model, NativeModel)
    calls: list[tuple[list[int], list[int]]] = []
    batched = NativeModel.decode_batch

    def recording(self, tokens, positions, caches):
        assert all(c is tiny.session.cache for c in caches)
        calls.append((list(tokens), list(positions)))
        return batched(self, tokens, positions, caches)

    monkeypatch.setattr(NativeModel, "decode_batch", recording)
    monkeypatch.setattr(model.native, "max_batch", max_batch)
    for ids in PROMPTS:
        plain, _ = run(tiny, ids, greedy(None))
        calls.clear()
        spec, stats = run(tiny, ids, greedy("lookup"))
        assert spec == plain
        rows = sum(len(t) for t, _ in calls)
        if max_batch > MAX_DRAFT:  # one call per fed token, its whole draft in it
            assert rows == len(calls) + stats.draft_tokens
        else:  # the draft's tail only as far as it is kept; every output token but the last fed once
            assert stats.completion_tokens - 1 <= rows <= len(calls) + stats.draft_tokens
        for tokens, positions in calls:
            assert 1 <= len(tokens) <= max_batch
            assert positions == list(range(positions[0], positions[0] + len(tokens)))
    assert any(len(t) == max_batch for t, _ in calls) or max_batch > MAX_DRAFT


def test_the_engine_default_and_bad_names(tiny: Engine) -> None:
    engine = Engine(tiny.artifact, threads=1, speculative="lookup")
    _, stats = run(engine, PROMPTS[2], greedy(None))
    assert stats.draft_tokens > 0 and stats.accepted_tokens <= stats.draft_tokens
    assert stats.as_dict()["draft_tokens"] == stats.draft_tokens
    with pytest.raises(EdgeLLMError, match="unknown speculative decoding 'draft'; known: lookup, draft:MODEL"):
        Engine(tiny.artifact, threads=1, speculative="draft")
    with pytest.raises(EdgeLLMError, match="unknown speculative decoding"):
        tiny.generate(PROMPTS[0], GenerationParams(speculative="nope"))


def test_sampled_speculative_requests_follow_the_seed(tiny: Engine) -> None:
    params = GenerationParams(temperature=0.9, top_k=40, seed=5, max_tokens=24, ignore_eos=True,
                              speculative="lookup")
    first, stats = run(tiny, PROMPTS[2], params)
    again, _ = run(tiny, PROMPTS[2], params)
    assert first == again and stats.draft_tokens > 0


# ---- the acceptance rule ---------------------------------------------------------------------------------------
def chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's chi-square test p-value: the chi-square survival function is the regularized upper incomplete
    gamma function Q(df / 2, x / 2)."""
    x = float(((observed - expected) ** 2 / expected).sum())
    df = observed.size - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(x / 2, dtype=torch.float64)))


def test_the_chi_square_p_value_is_right() -> None:
    assert chi_square_p(np.array([50.0, 50.0]), np.array([50.0, 50.0])) == 1.0
    # x = 3.841 with one degree of freedom is the 5% critical value (float64 reference tables)
    assert abs(chi_square_p(np.array([50 + 9.8, 50 - 9.8]), np.array([50.0, 50.0])) - 0.05) < 1e-3


@pytest.mark.parametrize("options", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 12, "top_p": 0.95}])
def test_kept_or_drawn_tokens_follow_the_models_distribution(tiny: Engine, options: dict) -> None:
    """Chi-square over the candidates of the tiny model's next-token distribution: for a likely, an unlikely and a
    filtered-out draft token, the kept-or-drawn token is distributed as the distribution itself."""
    logits = tiny.logits(PROMPTS[0]).numpy()[-1]
    scores, ids = filter_logits(logits, **options)
    ids = np.arange(logits.size) if ids is None else ids
    p = np.exp(scores - scores.max(), dtype=np.float64)
    p /= p.sum()
    order = np.argsort(-p)
    kept = set(ids.tolist())
    outside = next((t for t in range(logits.size) if t not in kept), int(ids[order[-1]]))  # else the least likely
    n = 20000
    for draft in (int(ids[order[0]]), int(ids[order[len(order) // 3]]), outside):
        generator = np.random.default_rng(1234)
        drawn = [accept_draft(logits, draft, generator, **options) for _ in range(n)]
        counts = np.array([drawn.count(int(t)) for t in ids])
        assert counts.sum() == n  # never a token outside the filtered candidates
        expected = n * p
        big = expected >= 5  # chi-square's usual condition; the rest pooled in one bin
        observed = np.append(counts[big], counts[~big].sum())
        want = np.append(expected[big], expected[~big].sum())
        if want[-1] == 0:
            observed, want = observed[:-1], want[:-1]
        assert chi_square_p(observed, want) > 1e-4, draft


def test_greedy_keeps_a_draft_only_at_the_argmax() -> None:
    logits = np.array([0.1, 2.0, 1.9, -1.0], dtype=np.float32)
    g = np.random.default_rng(0)
    assert accept_draft(logits, 1, g, temperature=0.0) == 1
    assert accept_draft(logits, 2, g, temperature=0.0) == 1


# ---- the real model ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2() -> Engine:
    return Engine.load("smollm2-135m", progress=False)


def test_smollm2_greedy_speculative_output_is_plain_output(smollm2: Engine) -> None:
    from edgellm.eval.tasks import load_dataset, messages

    items = load_dataset()
    prompts = [smollm2.render(messages(item)) for item in (items[0], items[7])]  # extraction: copies its input
    prompts += [smollm2.render([{"role": "user", "content": "Repeat after me: the quick brown fox jumps over the "
                                                            "lazy dog, the quick brown fox jumps over the lazy dog."}]),
                smollm2.render([{"role": "user", "content": "Write a haiku about the sea."}])]
    drafted = accepted = 0
    for prompt in prompts:
        plain = smollm2.generate(prompt, GenerationParams(temperature=0.0, max_tokens=64))
        spec = smollm2.generate(prompt, GenerationParams(temperature=0.0, max_tokens=64, speculative="lookup"))
        assert spec.text == plain.text and spec.token_ids == plain.token_ids
        drafted += spec.stats.draft_tokens
        accepted += spec.stats.accepted_tokens
    assert accepted > 0 and drafted > accepted


def test_smollm2_an_earlier_reply_drafts_a_later_extraction(smollm2: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two items of one extraction scenario: after the first's reply, the second's lookup keeps more drafted tokens
    than its own prompt gives it (the reply's JSON layout is in no prompt), and its output is still plain greedy's."""
    from edgellm.eval.tasks import load_dataset, messages

    items = load_dataset()
    first, second = (smollm2.render(messages(item)) for item in items[:2])
    params = GenerationParams(temperature=0.0, max_tokens=64, speculative="lookup")
    monkeypatch.setattr(smollm2.session, "reply_memory", ReplyMemory())
    alone = smollm2.generate(second, params)
    monkeypatch.setattr(smollm2.session, "reply_memory", ReplyMemory())
    smollm2.generate(first, params)
    after = smollm2.generate(second, params)
    plain = smollm2.generate(second, GenerationParams(temperature=0.0, max_tokens=64))
    assert after.token_ids == alone.token_ids == plain.token_ids
    assert after.stats.accepted_tokens > alone.stats.accepted_tokens


# ---- drafts under an output constraint -------------------------------------------------------------------------
class ScriptedFork:
    """A constraint over one output `script`: at a position in `free` any token below 100 goes, elsewhere only the
    script's token (forced: the script's run up to the next free position)."""

    def __init__(self, script: list[int], free: set[int]) -> None:
        self.script, self.free, self.at = script, free, 0

    def forced_tokens(self) -> list[int]:
        run, i = [], self.at
        while i < len(self.script) and i not in self.free:
            run.append(self.script[i])
            i += 1
        return run

    def accept_token(self, token: int) -> bool:
        ok = self.at < len(self.script) and (token < 100 if self.at in self.free else token == self.script[self.at])
        self.at += ok
        return ok


def test_drafts_take_the_forced_tokens_and_only_lookup_tokens_the_constraint_allows() -> None:
    """Forced tokens go in where they come, outside the lookup length (up to max_draft and the room left); lookup
    continues from the history with the draft so far; a lookup token the constraint refuses ends the draft."""
    script = [200, 201, 5, 6, 7, 202, 8, 9]  # forced 200 201, free 5 6 7, forced 202, free 8 9
    history = [1, 200, 201, 5, 6, 7, 202, 8, 9, 3]

    def drafter(free: set[int], history: list[int] = history, **kw: int) -> LookupDrafter:
        return LookupDrafter(history, constraint=lambda: ScriptedFork(script, free), **kw)  # a fresh copy each time

    d = drafter({2, 3, 4, 6, 7})
    d.length = 3  # three lookup tokens, with the forced runs around them
    assert d.propose(99) == [200, 201, 5, 6, 7, 202] and d.forced == 3
    d = drafter({2, 3, 4, 6, 7})
    d.length = 6  # (200, 201) found the copy: 5 6 7 202 8 9 (202 is lookup's here, as the constraint allows)
    assert d.propose(99) == script == history[1:9] and d.forced == 2
    d = drafter({2, 3, 4, 6, 7})
    d.length = 1  # one lookup token: the forced run before it and after it still go in
    assert d.propose(99) == [200, 201, 5] and d.forced == 2  # then 6 would be a second lookup token
    d = drafter({2, 3, 4, 6, 7}, max_draft=4)
    d.length = 8
    assert d.propose(99) == [200, 201, 5, 6] and d.propose(3) == [200, 201, 5]  # max_draft, then the room left
    d = drafter({2, 3, 4, 6, 7}, history=[1, 200, 201, 5, 150, 3])
    d.length = 8
    assert d.propose(99) == [200, 201, 5]  # 150 (lookup's next) is refused where the constraint lets < 100 in
    d = LookupDrafter(history + [1], constraint=lambda: None)
    d.length = 3
    assert d.propose(99) == [200, 201, 5] and d.forced == 0  # no constraint state (it ended): plain lookup


class MisspelledFork(ScriptedFork):
    """A constraint whose forced text the tokenizer spells with a token it refuses (as a prefix space would)."""

    def forced_tokens(self) -> list[int]:
        run = super().forced_tokens()
        return [999, *run] if run else []


def test_forced_tokens_the_constraint_refuses_are_not_drafted() -> None:
    d = LookupDrafter([1, 200, 201, 5, 6, 7, 202, 8, 9, 3, 1], constraint=lambda: MisspelledFork([200, 201, 5], {2}))
    d.length = 3
    assert d.propose(99) == [200, 201, 5] and d.forced == 0  # lookup's tokens, as the constraint takes them


def test_a_kept_forced_draft_lengthens_the_next_lookup_as_any_draft() -> None:
    d = LookupDrafter([1, 200, 201, 5, 3], constraint=lambda: ScriptedFork([200, 201, 5], {2}))
    assert d.length == START_DRAFT and d.propose(99) == [200, 201, 5]
    d.extend([200, 201, 5])
    assert d.length == START_DRAFT + 1


def test_the_grammar_fork_spells_forced_text_in_the_tokenizers_tokens(smollm2: Engine) -> None:
    """The fork of a JSON-schema constraint drafts the forced start as the tokenizer writes it, advances on its own
    (the constraint's own state stays), refuses what the grammar forbids, and drafts nothing once a stop is taken."""
    from edgellm.response_format import ResponseFormat

    schema = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris"]}}, "required": ["city"],
              "additionalProperties": False}
    params = GenerationParams(response_format=ResponseFormat(type="json_schema", schema=schema))
    constraint = smollm2.constraint(params)
    assert constraint is not None
    tok = smollm2.tokenizer
    fork = constraint.fork()
    assert fork is not None
    forced = fork.forced_tokens()
    assert forced == tok.encode('{"city": "Paris"}', add_bos=False)  # the whole reply is forced
    assert all(fork.accept_token(t) for t in forced)
    assert fork.forced_tokens() == [] and not fork.accept_token(forced[0])  # done: only a stop may follow
    assert fork.accept_token(tok.eos_token_id) and fork.forced_tokens() == []  # terminated: nothing more
    again = constraint.fork()
    assert again is not None and again.forced_tokens() == forced  # the constraint itself did not move


def test_smollm2_constrained_lookup_output_is_plain_output(smollm2: Engine) -> None:
    """Constrained extraction (`eval task`'s constrained mode), greedy: the drafts the grammar forces are most of
    what is drafted and kept, and the output is plain decoding's, token for token; seeded sampling repeats and stays
    valid under the schema."""
    import jsonschema

    from edgellm.eval.tasks import load_dataset, messages
    from edgellm.response_format import ResponseFormat

    items = load_dataset()[::25]
    forced = kept = 0
    for item in items:
        prompt = smollm2.render(messages(item))
        fmt = ResponseFormat(type="json_schema", schema=item["schema"])
        plain = smollm2.generate(prompt, GenerationParams(temperature=0.0, max_tokens=96, response_format=fmt))
        spec = smollm2.generate(prompt, GenerationParams(temperature=0.0, max_tokens=96, response_format=fmt,
                                                         speculative="lookup"))
        assert spec.token_ids == plain.token_ids and spec.text == plain.text and spec.complete
        forced += spec.stats.forced_draft_tokens
        kept += spec.stats.accepted_tokens
        sampled = [smollm2.generate(prompt, GenerationParams(temperature=0.8, seed=3, max_tokens=96,
                                                             response_format=fmt, speculative="lookup"))
                   for _ in range(2)]
        assert sampled[0].token_ids == sampled[1].token_ids
        if sampled[0].complete:
            jsonschema.validate(json.loads(sampled[0].text), item["schema"])
    assert forced > 0 and kept > forced // 2
