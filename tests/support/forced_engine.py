"""An engine whose every reply is held to a fixed text by a grammar: the real model samples it token by token under
the sampler's mask (``engine/grammar.py``), so a test can make the model write what a test needs (a URL no source
holds) through the whole real path: engine, reply stream, socket, database."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncGenerator

from engine.fair_share import DEFAULT_SHARE, FairShare
from engine.llm_engine import LLMEngine
from engine.outputs import GenerationEvent
from engine.prompt_encoder import Prompt
from engine.sampling_params import GrammarKind, SamplingParams, StructuredOutput


class ForcedReplyEngine(LLMEngine):
    """``forced``: what every reply is (set it before a request; a test's own engine)."""

    forced = ""

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        namespace: str = "default",
        request_id: str | None = None,
        session: str | None = None,
        share: FairShare = DEFAULT_SHARE,
    ) -> AsyncGenerator[GenerationEvent, None]:
        grammar = StructuredOutput(GrammarKind.LARK, f"start: {json.dumps(self.forced)}")
        forced = dataclasses.replace(params or SamplingParams(), structured=grammar)
        async for event in super().generate(prompt, forced, namespace, request_id, session, share):
            yield event
