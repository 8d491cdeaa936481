"""The routing policy file: every bad field is one clear error; decisions follow the first matching rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgellm.router.decide import RequestFacts, decide, request_tags
from edgellm.router.policy import PolicyError, load_policy, parse_policy

REMOTE = {"name": "cloud", "base_url": "http://127.0.0.1:9/v1", "model": "big"}


def policy(**extra):
    return parse_policy({"remote": [REMOTE], **extra})


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"remote": [{**REMOTE, "base_url": "ftp://x"}]}, "remote 'cloud': base_url must be an http(s) URL"),
        ({"remote": [{**REMOTE, "modle": "x"}]}, "remote 'cloud': unknown field 'modle'"),
        ({"remote": [{k: v for k, v in REMOTE.items() if k != "model"}]}, "remote 'cloud': model is required"),
        ({"remote": [REMOTE, REMOTE]}, "remote 'cloud' is defined twice"),
        ({"remote": [{**REMOTE, "name": "local"}]}, "the name 'local' is reserved"),
        ({"remote": [{**REMOTE, "timeout_s": -1}]}, "timeout_s must be a number of seconds > 0"),
        ({"remote": [{**REMOTE, "json_schema": "yes"}]}, "json_schema must be true or false"),
        ({"rule": [{"route": "moon"}]}, "rule 1: route 'moon' is neither 'local' nor a remote"),
        ({"rule": [{"name": "long", "route": "local", "prompt_tokens_over": "many"}]},
         "rule 1 (long): prompt_tokens_over must be a whole number >= 0"),
        ({"rule": [{"route": "local", "prompt_tokens_over": True}]}, "prompt_tokens_over must be a whole number"),
        ({"rule": [{"route": "local", "device_tier": "huge"}]}, "device_tier has 'huge'; expected one of low, mid, high"),
        ({"rule": [{"route": "local", "power_mode": ["saver", "turbo"]}]}, "power_mode has 'turbo'"),
        ({"rule": [{"route": "local", "when": 1}]}, "rule 1: unknown field 'when'"),
        ({"rule": {"route": "local"}}, "rule must be an array of tables"),
        ({"default": "moon"}, "default 'moon' is neither 'local' nor a remote"),
        ({"fallback": {"local_error": "moon"}}, "fallback: local_error 'moon' is not a remote"),
        ({"fallback": {"local_timeout": "cloud"}}, "fallback: local_timeout needs local_timeout_s"),
        ({"fallback": {"remote_error": "retry"}}, "fallback: remote_error must be 'local' or 'error'"),
        ({"fallbacks": {}}, "unknown top-level field 'fallbacks'"),
    ],
)
def test_bad_fields_are_named(raw, message):
    raw = {"remote": [REMOTE], **raw} if "remote" not in raw else raw
    with pytest.raises(PolicyError) as info:
        parse_policy(raw)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_file_errors_name_the_file(tmp_path: Path):
    with pytest.raises(PolicyError, match="does not exist"):
        load_policy(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("default = \n")
    with pytest.raises(PolicyError, match=r"bad.toml is not valid TOML"):
        load_policy(bad)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('[[rule]]\nroute = "moon"\n')
    with pytest.raises(PolicyError, match=r"routing policy .*wrong.toml: rule 1: route 'moon'"):
        load_policy(wrong)


def test_a_full_policy_reads(tmp_path: Path):
    path = tmp_path / "route.toml"
    path.write_text("""
default = "local"
[[remote]]
name = "cloud"
base_url = "https://api.example.com/v1/"
model = "gpt-4o-mini"
api_key_env = "CLOUD_KEY"
timeout_s = 30
[[rule]]
name = "long documents"
route = "cloud"
prompt_tokens_over = 2000
[fallback]
local_error = "cloud"
local_timeout = "cloud"
local_timeout_s = 20
remote_error = "error"
""")
    p = load_policy(path)
    assert p.remotes["cloud"].base_url == "https://api.example.com/v1"
    assert p.remotes["cloud"].timeout_s == 30.0
    assert p.rules[0].name == "long documents" and p.rules[0].prompt_tokens_over == 2000
    assert p.fallback.local_timeout_s == 20.0 and p.fallback.remote_error == "error"


@pytest.mark.parametrize(
    ("rule", "facts", "hit"),
    [
        ({"prompt_tokens_over": 100}, {"prompt_tokens": 101}, True),
        ({"prompt_tokens_over": 100}, {"prompt_tokens": 100}, False),
        ({"prompt_tokens_at_most": 10}, {"prompt_tokens": 10}, True),
        ({"prompt_tokens_at_most": 10}, {"prompt_tokens": 11}, False),
        ({"max_tokens_over": 500}, {"prompt_tokens": 1, "max_tokens": 501}, True),
        ({"max_tokens_over": 500}, {"prompt_tokens": 1, "max_tokens": None}, False),
        ({"task": ["summarize", "translate"]}, {"prompt_tokens": 1, "task": "translate"}, True),
        ({"task": "summarize"}, {"prompt_tokens": 1, "task": None}, False),
        ({"device_tier": "low"}, {"prompt_tokens": 1, "device_tier": "low"}, True),
        ({"device_tier": "low"}, {"prompt_tokens": 1, "device_tier": "high"}, False),
        ({"free_memory_below_mib": 512}, {"prompt_tokens": 1, "free_memory_mib": 300}, True),
        ({"free_memory_below_mib": 512}, {"prompt_tokens": 1, "free_memory_mib": None}, False),
        ({"power_mode": "saver"}, {"prompt_tokens": 1, "power_mode": "saver"}, True),
        ({"power_mode": "saver"}, {"prompt_tokens": 1, "power_mode": "balanced"}, False),
        ({"queue_depth_over": 2}, {"prompt_tokens": 1, "queue_depth": 3}, True),
        ({"queue_depth_over": 2}, {"prompt_tokens": 1, "queue_depth": 2}, False),
        ({"prompt_tokens_over": 10, "task": "qa"}, {"prompt_tokens": 50, "task": "chat"}, False),  # AND
        ({}, {"prompt_tokens": 1}, True),
    ],
)
def test_each_condition(rule, facts, hit):
    p = policy(rule=[{"name": "r", "route": "cloud", **rule}])
    d = decide(p, RequestFacts(**facts))
    assert (d.target, d.reason) == (("cloud", "r") if hit else ("local", "default"))


def test_first_matching_rule_wins_and_default_applies():
    p = policy(default="cloud", rule=[{"name": "short", "route": "local", "prompt_tokens_at_most": 10},
                                      {"name": "any", "route": "cloud"}])
    assert decide(p, RequestFacts(prompt_tokens=5)).reason == "short"
    assert decide(p, RequestFacts(prompt_tokens=50)).reason == "any"
    assert decide(policy(default="cloud"), RequestFacts(prompt_tokens=5)).target == "cloud"


def test_privacy_beats_every_rule_and_the_default():
    p = policy(default="cloud", rule=[{"name": "all", "route": "cloud"}])
    d = decide(p, RequestFacts(prompt_tokens=10_000, private=True))
    assert (d.target, d.reason) == ("local", "privacy")


def test_a_remote_without_json_schema_keeps_schema_requests_local():
    p = parse_policy({"remote": [{**REMOTE, "json_schema": False}], "default": "cloud"})
    assert decide(p, RequestFacts(prompt_tokens=1, wants_json_schema=True)).target == "local"
    assert decide(p, RequestFacts(prompt_tokens=1)).target == "cloud"


def test_request_tags_from_headers_or_metadata():
    assert request_tags({"X-Edgellm-Task": "summarize"}, {}) == ("summarize", False)
    assert request_tags({"x-edgellm-privacy": "local"}, {}) == (None, True)
    assert request_tags({}, {"metadata": {"task": "qa", "privacy": "local-only"}}) == ("qa", True)
    assert request_tags({"X-Edgellm-Privacy": "public"}, {}) == (None, False)  # refusals: test_serve_security.py
