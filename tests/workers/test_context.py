"""The round's context view and the sync that compares only what changed (polyspec.workers.core.context)."""

from __future__ import annotations

import random

import pytest

from polyspec.workers.core.context import Context, Synced, extended, head
from polyspec.workers.core.tree import common_prefix


def test_a_context_reads_as_the_committed_prefix_then_its_tail():
    committed = [1, 2, 3, 4]
    context = Context(committed, 3, (7, 8))
    assert len(context) == 5 and list(context) == [1, 2, 3, 7, 8] and context.tokens() == [1, 2, 3, 7, 8]
    assert context[0] == 1 and context[3] == 7 and context[-1] == 8
    assert context[2:4] == [3, 7] and context[4:] == [8] and context[:2] == [1, 2] and context[::2] == [1, 3, 8]
    assert context + [9] == [1, 2, 3, 7, 8, 9] and context == [1, 2, 3, 7, 8]
    with pytest.raises(IndexError):
        context[5]
    committed.append(5)  # the list grows: the view is still its first 3 tokens and the tail
    assert list(context) == [1, 2, 3, 7, 8]
    assert list(extended(context, [9])) == [1, 2, 3, 7, 8, 9] and extended(context, [9]).base is committed
    assert extended([1, 2], [3]) == [1, 2, 3]
    assert list(head(context, 4)) == [1, 2, 3, 7] and list(head(context, 2)) == [1, 2] and head([1, 2, 3], 2) == [1, 2]


def test_sync_agrees_with_the_whole_comparison_over_rounds_of_a_request():
    """A tier's cache through 300 rounds of one request: each round it syncs to the committed tokens (some rounds
    with a middle tier's speculative tail), then writes its own drafted tokens past them; the committed list
    gets the accepted ones and a correction. Every sync gives what comparing the whole context gives."""
    rng = random.Random(5)
    committed = [rng.randrange(50) for _ in range(20)]
    cached: list[int] = []
    synced = Synced()
    for _ in range(300):
        tail = tuple(rng.randrange(50) for _ in range(rng.choice((0, 0, 3))))
        context = Context(committed, len(committed), tail)
        expected = common_prefix(cached, list(context))
        assert synced.agreed(cached, context) == expected
        del cached[expected:]
        cached.extend(context[expected:])
        drafted = [rng.randrange(50) for _ in range(rng.randrange(6))]
        cached.extend(drafted)  # the tier's own proposals, past the context
        accepted = rng.randrange(len(drafted) + 1)
        committed.extend(list(tail) + drafted[:accepted] + [rng.randrange(50)])


def test_sync_compares_only_past_the_committed_tokens_it_last_synced_to():
    """The committed list only grows, so a sync trusts what it synced to before: a change below that (which the
    scheduler never makes) goes unseen. A plain list, or another committed list, is compared whole."""
    committed = list(range(100))
    cached = list(range(100))
    synced = Synced()
    assert synced.agreed(cached, Context(committed)) == 100
    committed[10] = -1  # (breaks the contract: to show what is not compared)
    assert synced.agreed(cached, Context(committed)) == 100
    assert synced.agreed(cached, list(committed)) == 10  # a plain list: compared whole, nothing remembered
    assert synced.agreed(cached, Context(committed)) == 10
    assert synced.agreed(cached, Context(list(range(100))), remember=False) == 100  # another list: compared whole
