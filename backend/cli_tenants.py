"""``kvchat tenants create|list`` and ``kvchat keys create|revoke|list``: the operator's tenant and key management.

Each command opens the configured database (``KVCHAT_DATABASE_URL``), does one transaction and prints the result; a
new key is printed once and only its hash is kept. Failures print one ``error:`` line and exit 1.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession

from backend.core.config import Settings
from backend.core.errors import BackendError, one_line_reason
from backend.db.engine import create_db_engine, create_sessionmaker
from backend.domain import KeyKind
from backend.services import tenants

Command = Callable[[AsyncSession, argparse.Namespace], Awaitable[None]]


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``tenants`` and ``keys`` on the ``kvchat`` parser."""
    t = sub.add_parser("tenants", help="create and list tenants").add_subparsers(dest="action", required=True)
    create = t.add_parser("create", help="create a tenant and print its first chat token and admin key (once)")
    create.add_argument("name", help="a unique name, e.g. the brand the tenant serves")
    create.add_argument("--system-prompt", default=tenants.DEFAULT_SYSTEM_PROMPT, help="the tenant's system prompt")
    create.set_defaults(func=_runner(_tenants_create))
    t.add_parser("list", help="list tenants").set_defaults(func=_runner(_tenants_list))

    k = sub.add_parser("keys", help="issue, revoke and list API keys").add_subparsers(dest="action", required=True)
    kc = k.add_parser("create", help="issue a key and print it (once)")
    kc.add_argument("--tenant", required=True, help="the tenant's name or id")
    kc.add_argument("--kind", choices=[k.value for k in KeyKind], required=True, help="chat token or admin key")
    kc.set_defaults(func=_runner(_keys_create))
    kr = k.add_parser("revoke", help="revoke a key by its id (see `keys list`)")
    kr.add_argument("key_id")
    kr.set_defaults(func=_runner(_keys_revoke))
    kl = k.add_parser("list", help="list a tenant's keys (prefixes only)")
    kl.add_argument("--tenant", required=True, help="the tenant's name or id")
    kl.set_defaults(func=_runner(_keys_list))


def _runner(command: Command) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            asyncio.run(_in_transaction(command, args))
        except BackendError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except (SQLAlchemyError, OSError) as exc:
            reason = one_line_reason(exc)
            print(f"error: the database failed: {reason} (is it migrated? `kvchat migrate`)", file=sys.stderr)
            return 1
        return 0

    return run


async def _in_transaction(command: Command, args: argparse.Namespace) -> None:
    engine = create_db_engine(Settings().resolved_database_url)
    try:
        async with create_sessionmaker(engine)() as db:
            await command(db, args)
            await db.commit()
    finally:
        await engine.dispose()


async def _tenants_create(db: AsyncSession, args: argparse.Namespace) -> None:
    tenant = await tenants.create_tenant(db, args.name, args.system_prompt)
    chat = await tenants.issue_key(db, tenant.id, KeyKind.CHAT)
    admin = await tenants.issue_key(db, tenant.id, KeyKind.ADMIN)
    print(f"tenant {tenant.name} ({tenant.id})")
    print(f"chat token (also an OpenAI API key): {chat.key}")
    print(f"admin API key: {admin.key}")
    print("these keys are shown once: only their hashes are stored")


async def _tenants_list(db: AsyncSession, _args: argparse.Namespace) -> None:
    rows = await tenants.list_tenants(db)
    print(f"{'id':36}  {'name':24}  created")
    for t in rows:
        print(f"{t.id:36}  {t.name[:24]:24}  {t.created_at:%Y-%m-%d %H:%M}")


async def _keys_create(db: AsyncSession, args: argparse.Namespace) -> None:
    tenant = await tenants.get_tenant(db, args.tenant)
    issued = await tenants.issue_key(db, tenant.id, KeyKind(args.kind))
    print(f"{issued.kind.value} key {issued.id} for tenant {tenant.name}: {issued.key}")
    print("shown once: only its hash is stored")


async def _keys_revoke(db: AsyncSession, args: argparse.Namespace) -> None:
    key = await tenants.revoke_live_key(db, args.key_id)
    print(f"revoked {key.kind} key {key.id} ({key.prefix}…)")


async def _keys_list(db: AsyncSession, args: argparse.Namespace) -> None:
    tenant = await tenants.get_tenant(db, args.tenant)
    print(f"{'id':36}  {'kind':5}  {'prefix':12}  {'created':16}  revoked")
    for k in await tenants.list_keys(db, tenant.id):
        revoked = f"{k.revoked_at:%Y-%m-%d %H:%M}" if k.revoked_at else "-"
        print(f"{k.id:36}  {k.kind:5}  {k.prefix:12}  {k.created_at:%Y-%m-%d %H:%M}  {revoked}")
