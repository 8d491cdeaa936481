"""Does a chat loop at a model's defaults? Ten scripted user turns, the history kept as `edgellm chat` keeps it;
reports, per seed, the most repeated non-blank line of any reply (a line written 3+ times in one reply is a loop).

    python scripts/chat_loop_check.py --model smollm2-135m --seeds 5
    python scripts/chat_loop_check.py --model smollm2-135m --seeds 5 --repetition-penalty 1.0
"""

from __future__ import annotations

import argparse
import collections
import os
import re

from edgellm.generation import GenerationParams
from edgellm.runtime.engine import Engine

TURNS = (
    "What is the capital of France?",
    "Tell me three things to see there.",
    "Write a haiku about the river that runs through it.",
    "What language do people speak there?",
    "How do I say 'thank you' in that language?",
    "List five French cheeses.",
    "Which of them is the softest?",
    "Write a short poem about cheese.",
    "Summarize our conversation in two sentences.",
    "Thank you, goodbye!",
)


def most_repeated(text: str) -> tuple[str, int]:
    """The reply's most repeated non-blank line (or comma-separated phrase) and how often it appears."""
    pieces = [p.strip().lower() for line in text.splitlines() for p in re.split(r"[,;]", line) if p.strip()]
    if not pieces:
        return "", 0
    piece, count = collections.Counter(pieces).most_common(1)[0]
    return piece, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seeds", type=int, default=5, help="chats, each with its own seed (default 5)")
    parser.add_argument("--seed", type=int, help="first seed (default: a new random one)")
    parser.add_argument("--repetition-penalty", type=float, help="override the model's default")
    parser.add_argument("--temperature", type=float, help="override the model's default")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="OpenAI's frequency penalty, over the reply's own tokens only (default 0)")
    parser.add_argument("--max-tokens", type=int, default=200, help="tokens per reply (default 200)")
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    engine = Engine.load(args.model, progress=False, threads=args.threads)
    base = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
    penalty = args.repetition_penalty if args.repetition_penalty is not None \
        else engine.config.sampling.repetition_penalty
    temperature = args.temperature if args.temperature is not None else engine.config.sampling.temperature
    print(f"{args.model}, temperature {temperature}, repetition penalty {penalty}, frequency penalty "
          f"{args.frequency_penalty}, seeds {base}..{base + args.seeds - 1}, {len(TURNS)} turns, up to "
          f"{args.max_tokens} tokens a reply")
    loops = 0
    for seed in range(base, base + args.seeds):
        messages: list[dict[str, str]] = []
        worst = ("", 0, 0)
        for turn, question in enumerate(TURNS, 1):
            messages.append({"role": "user", "content": question})
            params = GenerationParams(max_tokens=args.max_tokens, seed=seed * 100 + turn,
                                      temperature=args.temperature, repetition_penalty=args.repetition_penalty,
                                      frequency_penalty=args.frequency_penalty)
            reply = engine.chat(messages, params).text
            messages.append({"role": "assistant", "content": reply})
            piece, count = most_repeated(reply)
            if count > worst[1]:
                worst = (piece, count, turn)
        looped = worst[1] >= 3
        loops += looped
        print(f"seed {seed}: {'LOOP' if looped else 'ok'}, most repeated {worst[1]}x at turn {worst[2]}: "
              f"{worst[0][:60]!r}", flush=True)
    print(f"chats with a line repeated 3+ times in a reply: {loops}/{args.seeds}")
    engine.close()


if __name__ == "__main__":
    main()
