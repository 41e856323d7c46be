"""The context service: its process-wide topic scorers (one per name, MiniLM and its lock shared by its users), and
the context a customer message was observed with, which its turn reuses instead of reading it again."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from backend.context.handbook import HandbookFormat, HandbookLimits
from backend.context.shift_classifier import ShiftClassifier
from backend.core.namespaces import Namespaces
from backend.db.engine import create_db_engine, create_sessionmaker
from backend.domain import MessageStatus
from backend.services import handbook
from backend.services import sessions as store
from backend.services.context_service import ContextService, SessionContext
from backend.services.shared_scorer import section_embedder, shared_scorer
from backend.services.tenants import bootstrap_default_tenant
from engine.llm_engine import LLMEngine


def test_scorers_are_shared_per_name_and_minilm_users_share_one_encoder_and_lock() -> None:
    cosine, classifier, static = shared_scorer("minilm"), shared_scorer("clf-minilm"), shared_scorer("clf-static")
    assert shared_scorer("minilm") is cosine
    assert cosine.minilm is not None and classifier.minilm is cosine.minilm
    assert classifier.lock is cosine.lock  # (the encoder's embedding cache is one OrderedDict)
    assert static.minilm is None and static.lock is not cosine.lock


def test_prepare_fills_the_classifiers_cache_and_is_a_no_op_for_the_others() -> None:
    static = shared_scorer("clf-static")
    static.prepare("Your replacement ships tomorrow.")
    inner = static._scorer
    assert isinstance(inner, ShiftClassifier)
    assert "Your replacement ships tomorrow." in inner.embedder._cache  # type: ignore[attr-defined]
    shared_scorer("tfidf").prepare("Your replacement ships tomorrow.")  # nothing to embed: no error


# ---------------------------------------------------------------------- one context read per turn

PARCEL = "My parcel is late. Order #4061234567 was due on Monday, where is it?"
KETTLE = "Another thing: the kettle from order #5550001111 broke. Can I return it?"
HANDBOOK = (
    "## Late parcels\nTrack the parcel from your orders page; after 5 days we send a new one.\n\n"
    "## Returns\nA broken item can be returned within 30 days for a refund.\n"
)
REPLY = "I am sorry about that. Step 1: open your orders. Step 2: choose the parcel and press Track."


@pytest.mark.anyio
async def test_the_context_a_turn_planned_with_is_what_reading_it_again_gives(
    db_url: str, tiny_engine: LLMEngine
) -> None:
    """The chat reads the context with the message, plans the turn from it (the message observed, the prompt
    prepared) and stores the observation beside the prefill: the prompt is the one a read after the store gives."""
    db_engine = create_db_engine(db_url)
    maker = create_sessionmaker(db_engine)
    context = ContextService(maker, tiny_engine, Namespaces(b"test-secret"))
    try:
        tenant_id = (await bootstrap_default_tenant(maker, "c", "a")).tenant_id
        async with maker() as db:
            session_id = (await store.create_session(db, tenant_id)).id
            await db.commit()
        budget = tiny_engine.prompt_limit - 16
        for n, text in enumerate([PARCEL, "Where is it now?", KETTLE]):  # the third starts a new topic epoch
            async with maker() as db:
                read = await context.load(db, tenant_id, session_id)
            async with maker() as db:
                message, _ = await store.add_user_message(db, session_id, f"m{n}", text)
            plan = context.plan(read.with_message(message), message, budget)
            assert plan.observation is not None
            stored = await context.record_customer(plan.context, message, plan.observation)
            async with maker() as db:
                again = await context.load(db, tenant_id, session_id)
            assert _contents(stored) == _contents(again)
            assert plan.prepared.token_ids == context.prepare(again, message.seq, budget).token_ids
            assert context.prepare(stored, message.seq, budget) == context.prepare(again, message.seq, budget)
            async with maker() as db:
                reply = await store.add_assistant_message(
                    db, session_id, message.seq, REPLY, MessageStatus.COMPLETE, store.TokenUsage()
                )
            await context.observe_reply(stored, reply, plan.observation.update.epoch)
        assert plan.observation is not None and plan.observation.update.shift and plan.context.epoch == 1
    finally:
        await db_engine.dispose()


def _contents(ctx: SessionContext) -> tuple[object, ...]:
    """What a context holds, its ORM rows by their stored values."""
    return (
        ctx.namespace,
        ctx.system_prompt,
        ctx.epoch,
        ctx.temperature,
        [(m.seq, m.role, m.content, m.status, m.reply_to_seq) for m in ctx.messages],
        ctx.epochs,
        ctx.temperatures,
        ctx.blocks,
        ctx.block_ids,
        ctx.settings,
        ctx.last_seq,
    )


@pytest.mark.anyio
async def test_prefetch_encodes_a_message_for_the_section_choice_before_its_turn_plans(
    db_url: str, tiny_engine: LLMEngine
) -> None:
    """Step 0 of the turn path: the message's vector is computed while it is stored, so the plan finds it cached."""
    db_engine = create_db_engine(db_url)
    maker = create_sessionmaker(db_engine)
    context = ContextService(maker, tiny_engine, Namespaces(b"test-secret"))
    try:
        tenant_id = (await bootstrap_default_tenant(maker, "c", "a")).tenant_id
        assert context.prefetch(tenant_id, PARCEL) is None  # (no index built yet: nothing to encode for)
        async with maker() as db:
            await handbook.replace(
                db,
                tiny_engine,
                Namespaces(b"test-secret"),
                tenant_id,
                HANDBOOK,
                HandbookFormat.MARKDOWN,
                HandbookLimits(),
            )
            await db.commit()
        async with maker() as db:
            session_id = (await store.create_session(db, tenant_id)).id
            await db.commit()
            await context.load(db, tenant_id, session_id)  # (builds the tenant's handbook index)
        text = f"Can I still change the delivery address of order #{secrets.randbelow(10**10)}?"
        cache = section_embedder()._embedder._cache  # (the process's: a new text each run)
        assert text not in cache
        future = context.prefetch(tenant_id, text)
        assert future is not None
        vectors = await asyncio.wrap_future(future)
        assert vectors is not None and vectors.shape[0] == 1
        assert text in cache
    finally:
        await db_engine.dispose()
