"""OpenAI-compatible API: ``POST /v1/chat/completions`` (streaming or not) and ``GET /v1/models``.

Auth: ``Authorization: Bearer <key>`` where the key is a tenant's chat token; the server derives the cache namespace
from the tenant (``backend/core/namespaces.py``): nothing in the request chooses it.
Errors come back in OpenAI's shape (see ``backend.openai.errors``).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Security
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials

from backend.api.deps import BEARER, StateDep, bearer_token
from backend.db.models import Tenant
from backend.domain import DraftsSetting, KeyKind
from backend.openai.errors import OpenAIRoute, unauthorized
from backend.openai.schemas import ChatCompletion, ChatCompletionRequest, ErrorResponse, ModelCard, ModelList
from backend.services import handbook

_ERRORS: dict[int | str, dict[str, object]] = {code: {"model": ErrorResponse} for code in (400, 401, 404, 503)}
router = APIRouter(prefix="/v1", tags=["openai"], route_class=OpenAIRoute, responses=_ERRORS)


async def _chat_tenant(
    request: Request, state: StateDep, _bearer: Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)] = None
) -> Tenant:
    # NOTE: not DbDep: a streamed reply must not hold a pooled connection while it runs. The lookup runs its own short
    # session, shared by every request with the same key meanwhile (a burst costs one query).
    owner = await state.chat.keys.owner(bearer_token(request), KeyKind.CHAT)
    if owner is None:
        raise unauthorized()
    return owner.tenant


ChatTenantDep = Annotated[Tenant, Depends(_chat_tenant)]


@router.get("/models")
async def list_models(_: ChatTenantDep, state: StateDep) -> ModelList:
    return ModelList(data=[state.completions.model_card()])


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, _: ChatTenantDep, state: StateDep) -> ModelCard:
    return state.completions.model_card(model_id)


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, tenant: ChatTenantDep, state: StateDep, request: Request
) -> ChatCompletion | StreamingResponse:
    namespace = state.namespaces.of(tenant.id, tenant.cache_scope)
    grounding = await handbook.v1_grounding(state.sessionmaker, tenant) if tenant.v1_contact_guard else None
    drafts = DraftsSetting(tenant.drafts).wanted()
    return await state.completions.create(body, tenant.id, namespace, request.is_disconnected, grounding, drafts)
