"""``KeyWatch``: callbacks per key, called once on revocation; a connection registering just after its key's
revocation is called at once (for a minute); unwatched connections are never called."""

from __future__ import annotations

from backend.services.revocation import KeyWatch


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_revocation_calls_the_connections_of_that_key_once() -> None:
    watch = KeyWatch()
    called: list[str] = []
    watch.watch("k1", lambda: called.append("a"))
    watch.watch("k1", lambda: called.append("b"))
    watch.watch("k2", lambda: called.append("c"))
    assert watch.revoked(["k1"]) == 2
    assert called == ["a", "b"]
    assert watch.revoked(["k1"]) == 0  # called once, then forgotten
    assert watch.watched() == ["k2"]


def test_an_unwatched_connection_is_not_called() -> None:
    watch = KeyWatch()
    called: list[str] = []
    token = watch.watch("k1", lambda: called.append("gone"))
    watch.watch("k1", lambda: called.append("live"))
    watch.unwatch("k1", token)
    watch.revoked(["k1"])
    assert called == ["live"]
    watch.unwatch("k1", token)  # twice, or after the revocation: nothing
    assert watch.watched() == []


def test_a_connection_registering_after_the_revocation_is_called_at_once_for_a_minute() -> None:
    clock = Clock()
    watch = KeyWatch(clock)
    called: list[str] = []
    watch.revoked(["k1"])
    clock.now += 59.0
    watch.watch("k1", lambda: called.append("late"))
    assert called == ["late"]
    assert watch.watched() == []
    clock.now += 2.0  # 61 s after: a key revoked that long ago cannot have authenticated a new connection
    watch.watch("k1", lambda: called.append("much later"))
    assert called == ["late"] and watch.watched() == ["k1"]
