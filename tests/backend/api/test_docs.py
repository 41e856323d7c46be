"""/docs and /redoc work offline, and the OpenAPI schema tells clients how to send keys."""

from __future__ import annotations

import re

import httpx
import pytest

from backend.core.config import Settings
from backend.main import create_app

pytestmark = pytest.mark.anyio


@pytest.fixture
def client() -> httpx.AsyncClient:
    # NOTE: no lifespan runs here (no engine, no database): these pages need neither.
    app = create_app(Settings(database_url="sqlite+aiosqlite:///:memory:"))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kvchat")


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
async def test_docs_pages_load_every_asset_from_this_server(client: httpx.AsyncClient, page: str) -> None:
    async with client:
        html = await client.get(page)
        assert html.status_code == 200
        assets = re.findall(r'(?:src|href)="([^"]+)"', html.text)
        assert assets, "the page references no assets"
        for url in assets:
            assert url.startswith("/"), f"{page} loads {url} from another host"
            asset = await client.get(url)
            assert asset.status_code == 200, url
            assert len(asset.content) > 1000, url


async def test_openapi_declares_the_admin_key_and_the_bearer_token(client: httpx.AsyncClient) -> None:
    async with client:
        schema = (await client.get("/openapi.json")).json()
    schemes = schema["components"]["securitySchemes"]
    assert schemes["APIKeyHeader"] == {
        "type": "apiKey",
        "in": "header",
        "name": "X-API-Key",
        "description": "a tenant's admin API key",
    }
    assert schemes["HTTPBearer"]["scheme"] == "bearer"
    admin = schema["paths"]["/admin/sessions"]["get"]["security"]
    assert {"APIKeyHeader": []} in admin and {"HTTPBearer": []} in admin
    assert schema["paths"]["/v1/chat/completions"]["post"]["security"] == [{"HTTPBearer": []}]
