"""Admin: the tenant's handbook, the sections one of which each topic's prompt holds (``backend/services/handbook.py``).

A load replaces the whole handbook (Markdown: a section per heading; ``abcd``: JSON shaped like ABCD's agent
guidelines); a section's text can be replaced alone. Each edit bumps the handbook's version, which the audit row
names with what changed and the cached blocks it freed. Refusals are 422 ``invalid_handbook`` or ``handbook_limit``.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from backend.api.deps import AdminDep, DbDep, SettingsDep, StateDep, audit_note, audited
from backend.context.handbook import HandbookFormat, HandbookLimits
from backend.core.config import Settings
from backend.core.limits import SafeText
from backend.db.models import HandbookSection
from backend.services import handbook
from backend.services.handbook import HandbookEdit

router = APIRouter(prefix="/admin/tenant/handbook", tags=["admin: handbook"])
MAX_UPLOAD_CHARS = 2_000_000


class SectionOut(BaseModel):
    title: str
    text: str
    examples: list[str] = Field(description="example customer questions: read by the ranking, never in the prompt")
    version: int = Field(description="the handbook version that last changed this section")

    @classmethod
    def of(cls, row: HandbookSection) -> SectionOut:
        s = handbook.section_of(row)
        return cls(title=s.title, text=s.text, examples=list(s.examples), version=row.version)


class HandbookOut(BaseModel):
    version: int
    sections: list[SectionOut]


class HandbookIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: HandbookFormat = Field(description="markdown (a section per heading) or abcd (ABCD-style guideline JSON)")
    content: Annotated[SafeText, Field(max_length=MAX_UPLOAD_CHARS)]


class SectionIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    title: Annotated[SafeText, Field(min_length=1, max_length=200)]
    text: Annotated[SafeText, Field(min_length=1, max_length=100_000)]


class HandbookEditOut(BaseModel):
    version: int
    sections: int
    kept: int
    changed: list[str]
    added: list[str]
    removed: list[str]
    blocks_freed: int
    tokens_freed: int

    @classmethod
    def of(cls, e: HandbookEdit) -> HandbookEditOut:
        return cls(
            version=e.version,
            sections=e.sections,
            kept=e.kept,
            changed=list(e.changed),
            added=list(e.added),
            removed=list(e.removed),
            blocks_freed=e.freed.blocks_freed,
            tokens_freed=e.freed.tokens_freed,
        )


@router.get("", response_model=HandbookOut)
async def get_handbook(tenant: AdminDep, db: DbDep) -> HandbookOut:
    """The handbook's version and its sections in order."""
    rows = await handbook.sections_of(db, tenant.id)
    return HandbookOut(version=tenant.handbook_version, sections=[SectionOut.of(r) for r in rows])


@router.put("", response_model=HandbookEditOut, dependencies=[audited("tenant.handbook")])
async def load_handbook(
    body: HandbookIn, tenant: AdminDep, db: DbDep, state: StateDep, settings: SettingsDep, request: Request
) -> HandbookEditOut:
    """Replace the whole handbook. Unchanged sections keep their cached blocks; a changed or removed section's old
    text leaves the cache (every session's blocks after it too); the next turn of every session uses the new one."""
    edit = await handbook.replace(
        db, state.engine, state.namespaces, tenant.id, body.content, body.format, _limits(settings)
    )
    return _edited(request, edit)


@router.patch("/section", response_model=HandbookEditOut, dependencies=[audited("tenant.handbook")])
async def edit_section(
    body: SectionIn, tenant: AdminDep, db: DbDep, state: StateDep, settings: SettingsDep, request: Request
) -> HandbookEditOut:
    """Replace one section's text (by its title); its old text leaves the cache."""
    edit = await handbook.edit_section(
        db, state.engine, state.namespaces, tenant.id, body.title, body.text, _limits(settings)
    )
    return _edited(request, edit)


@router.delete("", response_model=HandbookEditOut, dependencies=[audited("tenant.handbook")])
async def clear_handbook(tenant: AdminDep, db: DbDep, state: StateDep, request: Request) -> HandbookEditOut:
    """Remove every section: prompts hold no handbook text from the next turn on."""
    return _edited(request, await handbook.clear(db, state.engine, state.namespaces, tenant.id))


def _edited(request: Request, edit: HandbookEdit) -> HandbookEditOut:
    audit_note(request, edit.describe())
    return HandbookEditOut.of(edit)


def _limits(settings: Settings) -> HandbookLimits:
    return HandbookLimits(
        settings.max_handbook_sections, settings.max_handbook_section_chars, settings.max_handbook_chars
    )
