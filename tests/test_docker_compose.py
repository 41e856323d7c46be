"""docker-compose.yml and the Dockerfile cannot be run here (no Docker engine): check their structure instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def _default_services() -> dict[str, Any]:
    return {name: s for name, s in _compose()["services"].items() if "profiles" not in s}


def test_services_are_postgres_and_app() -> None:
    services = _default_services()
    assert set(services) == {"db", "app"}
    assert services["db"]["image"].startswith("postgres:")
    assert services["app"]["build"] == "."
    assert (ROOT / "Dockerfile").is_file()


def test_app_waits_for_healthy_db_and_migrates_first() -> None:
    services = _compose()["services"]
    assert services["app"]["depends_on"] == {"db": {"condition": "service_healthy"}}
    command = " ".join(services["app"]["command"])
    assert command.index("kvchat migrate") < command.index("kvchat serve")
    assert "pg_isready" in " ".join(services["db"]["healthcheck"]["test"])
    assert "/livez" in " ".join(services["app"]["healthcheck"]["test"])


def test_app_env_points_at_the_db_service_and_sets_a_secret() -> None:
    env = _compose()["services"]["app"]["environment"]
    db_env = _compose()["services"]["db"]["environment"]
    url = env["KVCHAT_DATABASE_URL"]
    assert url.startswith("postgresql+asyncpg://")
    assert f"{db_env['POSTGRES_USER']}:{db_env['POSTGRES_PASSWORD']}@db:5432/{db_env['POSTGRES_DB']}" in url
    assert env["KVCHAT_ENV"] == "production"
    assert "KVCHAT_SECRET_KEY" in env
    assert env["KVCHAT_PORT"] == "8000"


def test_ports_and_volumes() -> None:
    compose = _compose()
    assert compose["services"]["app"]["ports"] == ["8000:8000"]
    assert set(compose["volumes"]) == {
        "pgdata",
        "appdata",
        "engine1data",
        "engine2data",
        "appscaleddata",
        "appscaled2data",
    }


def test_dockerfile_pins_torch_and_copies_what_the_app_needs() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "torch==2.13.0" in text
    copied = {word for line in text.splitlines() if line.startswith("COPY ") for word in line.split()[1:-1]}
    assert {"engine", "backend", "migrations", "frontend_stub", "alembic.ini", "pyproject.toml"} <= copied
    assert "HEALTHCHECK" in text


def test_scale_out_profile_is_two_backend_workers_a_router_and_two_replicas() -> None:
    services = _compose()["services"]
    scaled = {name for name, s in services.items() if s.get("profiles") == ["scale-out"]}
    assert scaled == {"engine-1", "engine-2", "router", "app-scaled", "app-scaled-2"}
    for name in ("engine-1", "engine-2"):
        engine = services[name]
        assert engine["command"][:2] == ["kvchat", "engine-serve"]
        assert "KVCHAT_ENGINE_SECRET" in engine["environment"]
        assert "/health" in " ".join(engine["healthcheck"]["test"])
    assert services["engine-1"]["volumes"] != services["engine-2"]["volumes"]  # each replica: its own disk tier
    router = " ".join(services["router"]["command"])
    assert router.startswith("vllm-router") and "--policy consistent_hash" in router
    assert "http://engine-1:8100 http://engine-2:8100" in router
    assert set(services["router"]["depends_on"]) == {"engine-1", "engine-2"}
    app = services["app-scaled"]
    assert app["environment"]["KVCHAT_ENGINE_URL"] == "http://router:8200"
    assert app["environment"]["KVCHAT_ENGINE_REPLICAS"] == "http://engine-1:8100,http://engine-2:8100"
    assert app["depends_on"]["router"] == {"condition": "service_healthy"}
    assert app["ports"] == ["8001:8000"]
    second = services["app-scaled-2"]  # a second worker: the same service, its own port and data, started after
    assert {k: v for k, v in second.items() if k not in ("ports", "volumes", "depends_on")} == {
        k: v for k, v in app.items() if k not in ("ports", "volumes", "depends_on")
    }
    assert second["ports"] == ["8002:8000"] and second["volumes"] != app["volumes"]
    assert second["depends_on"] == {"app-scaled": {"condition": "service_healthy"}}
    assert second["environment"]["KVCHAT_DATABASE_URL"].startswith("postgresql")  # the fan-out rides on Postgres
    assert "vllm-router" in (ROOT / "Dockerfile").read_text()
