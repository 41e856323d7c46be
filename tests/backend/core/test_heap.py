"""The server's long-lived heap is frozen out of the garbage collector while serving, and handed back after."""

from __future__ import annotations

import gc
import weakref

from backend.core.heap import long_lived_heap_frozen


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_the_heap_is_frozen_inside_and_handed_back_after() -> None:
    dropped = _Node()
    gone = weakref.ref(dropped)
    del dropped  # garbage in a cycle: collected before the freeze, not frozen with the rest
    assert gc.get_freeze_count() == 0
    with long_lived_heap_frozen() as frozen:
        assert gone() is None
        assert frozen > 0 and gc.get_freeze_count() > 0  # (a frozen object freed by its refcount leaves the count)
        assert len(gc.get_objects()) < frozen  # a full collection no longer walks them
    assert gc.get_freeze_count() == 0


def test_garbage_made_while_serving_is_still_collected() -> None:
    with long_lived_heap_frozen():
        made = _Node()
        gone = weakref.ref(made)
        del made
        gc.collect()
        assert gone() is None
