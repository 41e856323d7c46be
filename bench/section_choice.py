"""What choosing a topic's handbook section costs per customer message, and what ranking an epoch from its messages'
vectors changes against encoding its joined text (issue 43).

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.section_choice [--sessions 30]

The ABCD handbook with the dev split's examples (as ``bench.grounding`` loads it); held-out CuCom conversations
replayed as the chat observes them (the topic tracker's epochs, ``choose`` at every customer message, the encoder's
cache warm with the earlier texts). Two ways to give a grown query its sentence vector, each with an empty cache:
``joined`` (the vector of the joined text: a new text every turn, as before issue 43) and ``mean`` (the unit mean of
the messages' vectors: ``backend/context/sections.py``). Printed: the choice's cost per message, how often the two
agree, and top-1 flow accuracy on epochs of 1, 2 and 3 held-out labelled requests of one flow.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

from backend.context.handbook import HandbookFormat, parse
from backend.context.rules import DEFAULT_RULES, RuleSet
from backend.context.sections import ChoiceSettings, SectionIndex, choose, next_choice
from backend.context.similarity import MiniLMSimilarity
from backend.context.topic import TopicSettings, TopicTracker, identifier_keys
from backend.domain import MessageRole
from backend.services.shared_scorer import shared_scorer
from bench.datasets import CONVERSATIONS, GUIDELINES, read_text
from bench.grounding import REQUESTS, load_sessions, with_examples

Choose = Callable[[SectionIndex, Sequence[str], ChoiceSettings], tuple[int, ...]]


def choose_joined(index: SectionIndex, messages: Sequence[str], settings: ChoiceSettings) -> tuple[int, ...]:
    """``choose`` as it was before issue 43: each grown query's vector encoded from the joined text."""
    chosen: tuple[int, ...] = ()
    query = ""
    for message in messages:
        query = f"{query}\n{message}" if query else message
        ranked = index.ranked(query, settings.bm25_weight, settings.example_weight, settings.group_weight)
        chosen = next_choice(chosen, ranked, settings)
    return chosen


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.section_choice", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=30, help="held-out CuCom conversations replayed")
    args = p.parse_args(argv)
    requests = [json.loads(line) for line in read_text(REQUESTS).splitlines() if line.strip()]
    sections = with_examples(parse(read_text(GUIDELINES), HandbookFormat.ABCD), requests)
    encoder = MiniLMSimilarity().encoder
    settings = ChoiceSettings()
    sessions = load_sessions(CONVERSATIONS, args.sessions, 8)
    rules = RuleSet.compile(DEFAULT_RULES)
    ways: dict[str, Choose] = {"joined": choose_joined, "mean": choose}
    picks: dict[str, list[tuple[int, ...]]] = {}
    for name, pick in ways.items():
        index = SectionIndex(sections, MiniLMSimilarity(encoder))
        ms: list[float] = []
        picks[name] = []
        for turns in sessions:
            topic = TopicSettings()
            tracker = TopicTracker(topic, shared_scorer(topic.backend), identifier_keys(rules))
            epoch: list[str] = []
            for turn in turns:
                if turn.role is not MessageRole.USER:
                    tracker.observe_context(turn.text)
                    continue
                epoch = [turn.text] if tracker.observe_customer(turn.text).shift else [*epoch, turn.text]
                started = time.perf_counter()
                picks[name].append(pick(index, epoch, settings))
                ms.append(1000 * (time.perf_counter() - started))
        ms.sort()
        print(
            f"{name}: {len(ms)} choices, p50 {statistics.median(ms):.1f} ms, p90 {ms[int(0.9 * len(ms))]:.1f} ms, "
            f"p99 {ms[int(0.99 * len(ms))]:.1f} ms, mean {statistics.fmean(ms):.1f} ms"
        )
    same = sum(a == b for a, b in zip(picks["joined"], picks["mean"], strict=True))
    print(f"the same choice: {same}/{len(picks['mean'])}")
    by_flow: dict[str, list[str]] = defaultdict(list)
    for r in requests:
        if r["split"] == "held_out":
            by_flow[r["flow"]].append(r["text"])
    for k in (1, 2, 3):
        epochs = [(f, texts[i : i + k]) for f, texts in by_flow.items() for i in range(0, len(texts) - k + 1, k)]
        for name, pick in ways.items():
            index = SectionIndex(sections, MiniLMSimilarity(encoder))
            hits = 0
            for flow, messages in epochs:
                chosen = pick(index, messages, settings)
                hits += bool(chosen) and sections[chosen[0]].title.split(": ")[0] == flow
            print(f"epochs of {k} held-out requests of one flow, {name}: top-1 flow {hits}/{len(epochs)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
