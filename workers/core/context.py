"""A request's context as the round hands it to a tier: a view, never a copy.

The scheduler holds each request's committed tokens in one list that only ever grows (`RequestState.committed`).
A round's context is that list's first `length` tokens, and, in a middle tier's rounds, the tokens that tier has
emitted past them so far (`tail`: speculative, the target may reject them). `Context` is that view: the scheduler
passes the list, a length and the tail, and copies nothing.

A tier that caches a request's tokens (a KV slot, the n-gram index) remembers what it last synced to
(`Synced`): the committed list and its length then. Tokens below that length cannot have changed since, so the
next sync compares only what lies past it (the previous round's block, the tokens committed since); the whole
context is compared only when the list differs (a new request on a kept cache, a plain list).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from polyspec.workers.core.tree import common_prefix


class Context(Sequence):
    """`base[:length] + tail` as a read-only sequence of token ids. `base` only grows while any view of it lives
    (the scheduler's committed tokens)."""

    __slots__ = ("base", "length", "tail")

    def __init__(self, base: list[int], length: int | None = None, tail: Sequence[int] = ()) -> None:
        self.base = base
        self.length = len(base) if length is None else length
        self.tail = tuple(tail)

    def __len__(self) -> int:
        return self.length + len(self.tail)

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                return self.tokens()[index]
            head = self.base[start : min(stop, self.length)] if start < self.length else []
            return head + list(self.tail[max(start - self.length, 0) : max(stop - self.length, 0)])
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("context index out of range")
        return self.base[index] if index < self.length else self.tail[index - self.length]

    def __iter__(self):
        for index in range(self.length):
            yield self.base[index]
        yield from self.tail

    def __add__(self, other) -> list[int]:
        return self.tokens() + list(other)

    def __eq__(self, other) -> bool:
        return isinstance(other, (list, tuple, Context)) and len(self) == len(other) and self.tokens() == list(other)

    __hash__ = None

    def __repr__(self) -> str:
        return f"Context({self.length} committed + {list(self.tail)})"

    def tokens(self) -> list[int]:
        """The tokens, as a new list."""
        return self.base[: self.length] + list(self.tail)

    def extended(self, tokens: Sequence[int]) -> "Context":
        """This context followed by `tokens` (a middle tier's emitted block): a view of the same committed list."""
        return Context(self.base, self.length, self.tail + tuple(tokens))


@dataclasses.dataclass
class Synced:
    """What a cache last synced to: the committed list of its context and that context's length within it. Until
    the cache is written with another list's tokens, its first `length` tokens are that list's."""

    base: list[int] | None = None
    length: int = 0

    def agreed(self, cached: Sequence[int], context: Sequence[int], remember: bool = True) -> int:
        """The longest common prefix of `cached` and `context`, comparing only past what is known to agree; then
        (`remember`) `context` is the one synced to: the caller keeps that prefix and writes the rest of it."""
        start = 0
        if isinstance(context, Context) and context.base is self.base:
            start = min(self.length, context.length, len(cached))
        agreed = start + common_prefix(cached[start:], context[start:])
        if not remember:
            return agreed
        if isinstance(context, Context):
            self.base, self.length = context.base, context.length
        else:
            self.base, self.length = None, 0
        return agreed


def extended(context: Sequence[int], tokens: Sequence[int]) -> Sequence[int]:
    """`context` followed by `tokens`: a view where `context` is one (`Context.extended`), else a new list."""
    return context.extended(tokens) if isinstance(context, Context) else list(context) + list(tokens)


def head(context: Sequence[int], length: int) -> Sequence[int]:
    """The first `length` tokens of `context`: a view where it is one."""
    if isinstance(context, Context):
        length = max(0, min(length, len(context)))
        return Context(context.base, min(length, context.length), context.tail[: max(0, length - context.length)])
    return context[: max(length, 0)]
