"""``kvchat tenants create|list``, ``kvchat keys create|revoke|list`` and ``kvchat agents create|list|rotate``: the
operator's tenant, key and agent management.

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
from backend.services import agents, tenants

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
    kinds = [k.value for k in KeyKind if k != KeyKind.AGENT]
    kc.add_argument("--kind", choices=kinds, required=True, help="chat token or admin key (agents: `kvchat agents`)")
    kc.set_defaults(func=_runner(_keys_create))
    kr = k.add_parser("revoke", help="revoke a key by its id (see `keys list`)")
    kr.add_argument("key_id")
    kr.set_defaults(func=_runner(_keys_revoke))
    kl = k.add_parser("list", help="list a tenant's keys (prefixes only)")
    kl.add_argument("--tenant", required=True, help="the tenant's name or id")
    kl.set_defaults(func=_runner(_keys_list))

    a = sub.add_parser("agents", help="add, list and rotate human agents").add_subparsers(dest="action", required=True)
    ac = a.add_parser("create", help="add a person who answers hand-offs and print their agent key (once)")
    ac.add_argument("--tenant", required=True, help="the tenant's name or id")
    ac.add_argument("name", help="the name the customer sees, e.g. Dana")
    ac.set_defaults(func=_runner(_agents_create))
    al = a.add_parser("list", help="list a tenant's agents")
    al.add_argument("--tenant", required=True, help="the tenant's name or id")
    al.set_defaults(func=_runner(_agents_list))
    ar = a.add_parser("rotate", help="revoke an agent's keys and print a new one (once)")
    ar.add_argument("--tenant", required=True, help="the tenant's name or id")
    ar.add_argument("agent", help="the agent's id or name")
    ar.set_defaults(func=_runner(_agents_rotate))


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
    print(f"{'id':36}  {'kind':5}  {'prefix':12}  {'created':16}  revoked")  # (an agent key shows as "agent")
    for k in await tenants.list_keys(db, tenant.id):
        revoked = f"{k.revoked_at:%Y-%m-%d %H:%M}" if k.revoked_at else "-"
        print(f"{k.id:36}  {k.kind:5}  {k.prefix:12}  {k.created_at:%Y-%m-%d %H:%M}  {revoked}")


async def _agents_create(db: AsyncSession, args: argparse.Namespace) -> None:
    tenant = await tenants.get_tenant(db, args.tenant)
    issued = await agents.create_agent(db, tenant.id, args.name)
    print(f"agent {issued.agent.name} ({issued.agent.id}) of tenant {tenant.name}")
    print(f"agent key {issued.key.id}: {issued.key.key}")
    print("shown once: only its hash is stored")


async def _agents_list(db: AsyncSession, args: argparse.Namespace) -> None:
    tenant = await tenants.get_tenant(db, args.tenant)
    print(f"{'id':36}  {'name':24}  created")
    for agent in await agents.list_agents(db, tenant.id):
        print(f"{agent.id:36}  {agent.name[:24]:24}  {agent.created_at:%Y-%m-%d %H:%M}")


async def _agents_rotate(db: AsyncSession, args: argparse.Namespace) -> None:
    tenant = await tenants.get_tenant(db, args.tenant)
    issued = await agents.rotate_agent_key(db, tenant.id, args.agent)
    print(f"agent key {issued.id}: {issued.key} ({len(issued.revoked)} older key(s) revoked)")
    print("shown once: only its hash is stored")
