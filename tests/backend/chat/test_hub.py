"""The hub's socket caps: per tenant, and per client within a tenant."""

from __future__ import annotations

from backend.chat.hub import ConnectionKey, SessionHub


def test_client_cap_leaves_room_for_other_clients_of_the_tenant() -> None:
    hub = SessionHub()
    alice, bob = ConnectionKey("t1", "alice"), ConnectionKey("t1", "bob")
    assert hub.try_connect(alice, tenant_cap=10, client_cap=2) is None
    assert hub.try_connect(alice, tenant_cap=10, client_cap=2) is None
    assert hub.try_connect(alice, tenant_cap=10, client_cap=2) == "too many connections for this client (limit 2)"
    assert hub.try_connect(bob, tenant_cap=10, client_cap=2) is None
    assert hub.connections("t1") == 3


def test_tenant_cap_counts_every_client_and_refusals_are_not_counted() -> None:
    hub = SessionHub()
    keys = [ConnectionKey("t1", f"c{i}") for i in range(3)]
    assert [hub.try_connect(k, tenant_cap=2, client_cap=5) for k in keys] == [
        None,
        None,
        "too many connections for this tenant (limit 2)",
    ]
    assert hub.connections("t1") == 2
    assert hub.try_connect(ConnectionKey("t2", "c0"), tenant_cap=2, client_cap=5) is None  # other tenants unaffected


def test_disconnect_frees_both_counts() -> None:
    hub = SessionHub()
    key = ConnectionKey("t1", "alice")
    assert hub.try_connect(key, tenant_cap=1, client_cap=1) is None
    hub.disconnect(key)
    assert hub.connections("t1") == 0
    assert hub.try_connect(key, tenant_cap=1, client_cap=1) is None
    hub.disconnect(key)
    hub.disconnect(key)  # a double disconnect never goes negative
    assert hub.connections("t1") == 0
