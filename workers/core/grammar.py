"""Structured output: a request's grammar (JSON schema, regex or EBNF) as a mask on every tier's rows.

docs/structured-output.md gives the lossless rule (every tier's rows restricted to what the grammar
allows, so the output is distributed as the target's restricted distribution) and the choice of
library (xgrammar). Types, top-down:
- `ConstraintSpec`: what a request asked for (kind and source), validated and compiled once per
  request before any model work (`GrammarBook.compile`: bounded in time; an invalid one is one line);
- `GrammarBook`: one chain's compiler (xgrammar's, over the target's tokenizer and vocabulary);
- `GrammarState`: one request's matcher. `allowed(context)` is the mask after a context (prompt then
  generated tokens): the matcher advances over the tokens past the prompt and rolls back to the
  longest prefix it shares with the last context it saw (a drafted block, then the accepted prefix).
  Masks are cached per position, so the tiers of one request share each one.

On a distributed chain the driver sends the constraint in the sequence header (`wire_form`) and each
tier makes its own matcher (`from_wire`). Masks are cached as xgrammar's packed bitmask (int32 words)
and unpacked to bool rows on the logits' device (numpy on the CPU, torch's shifts elsewhere).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import threading
from typing import Callable

import numpy as np
import torch

from polyspec.workers.core.errors import RequestError
from polyspec.workers.core.tree import common_prefix

KINDS = ("json_schema", "regex", "grammar")  # the request fields that constrain output (at most one per request)
MAX_SOURCE_CHARS = 64 * 1024  # a longer schema / regex / grammar is refused before compiling
MAX_SCHEMA_DEPTH = 64  # JSON nesting of a schema (a schema nesting 200 objects took 2.3 s to compile)
COMPILE_TIMEOUT_S = 10.0  # a grammar still compiling after this is refused (its thread finishes in the background)
MAX_COMPILING = 8  # compilations at once, each on a thread of its own (a slow one makes no other wait); more are refused
COMPILER_CACHE_BYTES = 256 << 20  # the compiler's cache of compiled grammars (shared by equal requests)
MASK_CACHE_POSITIONS = 256  # a request's cached masks (19 KB each at 151,936 tokens) past which the oldest are dropped
FINISH_GRAMMAR = "grammar"  # finish reason: the grammar allows no token of the vocabulary here (nor an end)
JSON_OBJECT_SCHEMA = {"type": "object"}  # OpenAI's response_format json_object: any JSON object
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


@dataclasses.dataclass(frozen=True)
class ConstraintSpec:
    """A request's constraint: `kind` (one of KINDS) and its source text (a JSON schema as JSON text),
    with the compiled grammar once `GrammarBook.compile` has checked it (excluded from equality)."""

    kind: str
    source: str
    strict: bool = True  # json_schema: properties not named are refused (OpenAI's strict; xgrammar's strict_mode)
    compiled: object = dataclasses.field(default=None, compare=False, repr=False)


def constraint_from_fields(raw: dict) -> ConstraintSpec | None:
    """The constraint named by a request's fields (`json_schema`: an object or its JSON text; `regex`,
    `grammar`: strings), checked for shape only; None when it names none. Raises RequestError."""
    named = [kind for kind in KINDS if raw.get(kind) is not None]
    if not named:
        return None
    if len(named) > 1:
        raise RequestError(f"give one of {', '.join(KINDS)}, not several ({' and '.join(named)})")
    kind, value = named[0], raw[named[0]]
    if kind == "json_schema":
        if isinstance(value, str):
            if len(value) > MAX_SOURCE_CHARS:
                raise RequestError(f"json_schema is {len(value)} characters; at most {MAX_SOURCE_CHARS} are compiled")
            try:
                value = json.loads(value)
            except RecursionError:
                raise RequestError(f"json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
            except ValueError as exc:
                raise RequestError(f"json_schema is not valid JSON: {exc}") from None
        if isinstance(value, bool):
            value = {} if value else {"not": {}}
        if not isinstance(value, dict):
            raise RequestError(f"json_schema must be a JSON object (a schema), got {type(value).__name__}")
        if nesting_depth(value) > MAX_SCHEMA_DEPTH:
            raise RequestError(f"json_schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        source = json.dumps(value)
    else:
        if not isinstance(value, str):
            raise RequestError(f"{kind} must be a string, got {type(value).__name__}")
        if not value:
            raise RequestError(f"{kind} is empty")
        source = value
    if len(source) > MAX_SOURCE_CHARS:
        raise RequestError(f"{kind} is {len(source)} characters; at most {MAX_SOURCE_CHARS} are compiled")
    return ConstraintSpec(kind, source)


_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")  # xgrammar's "[23:02:22] /project/cpp/file.cc:94: "


def nesting_depth(value) -> int:
    """How deep objects and arrays nest in a parsed JSON value (iteratively: no recursion limit to hit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_SCHEMA_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _xgrammar():
    """The grammar library, imported at the first constrained request; its absence is one line."""
    try:
        import xgrammar
    except ImportError:
        raise RequestError("structured output needs xgrammar: pip install xgrammar==0.2.9 (polyspec's pin)") from None
    return xgrammar


def one_line(exc: BaseException, limit: int = 240) -> str:
    """An exception's message on one line (without the library's time and source file), cut to `limit` characters."""
    text = _NATIVE_PREFIX.sub("", " ".join(str(exc).split())) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class GrammarBook:
    """One chain's grammar compiler: xgrammar's `GrammarCompiler` over the target's tokenizer, its
    vocabulary (`vocab_size`: the model's logit rows, which may be wider than the tokenizer's) and the
    chain's stop tokens (what a finished grammar allows: the request then ends as "eos"). Built lazily:
    the tokenizer's table takes ~0.6 s for a 151,936-token vocabulary."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...], tokenizer_source: str | None = None) -> None:
        """`tokenizer_source`: where the tokenizer loads from (the target's folder), for a distributed chain's tiers."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.tokenizer_source = tokenizer_source
        self._compiler = None
        self._lock = threading.Lock()
        self.compiling = 0  # compilations running, those past their bound included (their threads run on)

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                xgrammar = _xgrammar()
                if self.tokenizer is None:
                    raise RequestError("the target model has no tokenizer, so output cannot be constrained")
                info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                               stop_token_ids=list(self.stop_token_ids) or None)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_limit_bytes=COMPILER_CACHE_BYTES)
            return self._compiler

    def compile(self, spec: ConstraintSpec, timeout_s: float = COMPILE_TIMEOUT_S) -> ConstraintSpec:
        """`spec` with its compiled grammar; an invalid source, or one that takes more than `timeout_s` to
        compile, raises RequestError (one line)."""
        compiler = self.compiler()
        with self._lock:
            if self.compiling >= MAX_COMPILING:
                raise RequestError(f"{MAX_COMPILING} grammars are compiling already; send {spec.kind} again shortly")
            self.compiling += 1
        outcome: dict = {}
        done = threading.Event()

        def run() -> None:  # a thread of its own: a slow compile delays no other request's
            try:
                outcome["compiled"] = _compile(compiler, spec)
            except Exception as exc:  # noqa: BLE001 - xgrammar's parse errors (RuntimeError, ValueError, its own types)
                outcome["error"] = exc
            finally:
                with self._lock:
                    self.compiling -= 1
                done.set()

        threading.Thread(target=run, name="polyspec-grammar", daemon=True).start()
        if not done.wait(timeout_s):
            raise RequestError(f"{spec.kind} took longer than {timeout_s:g} s to compile; simplify it")
        if "error" in outcome:
            raise RequestError(f"invalid {spec.kind}: {one_line(outcome['error'])}")
        return dataclasses.replace(spec, compiled=outcome["compiled"])

    def start(self, spec: ConstraintSpec, prompt_len: int) -> "GrammarState":
        """A request's matcher over `spec` (compiled), for contexts whose first `prompt_len` tokens are its prompt."""
        if spec.compiled is None:
            spec = self.compile(spec)
        state = GrammarState(spec, prompt_len, self.vocab_size, self.stop_token_ids)
        state.tokenizer_source = self.tokenizer_source
        return state


def wire_form(state: "GrammarState") -> str:
    """A request's constraint as a distributed chain's tiers receive it (tier.proto SequenceHeader.constraint_json)."""
    spec = state.spec
    return json.dumps({"kind": spec.kind, "source": spec.source, "strict": spec.strict, "prompt_len": state.prompt_len,
                       "tokenizer": state.tokenizer_source})


_BOOKS: dict[tuple, GrammarBook] = {}
_BOOKS_LOCK = threading.Lock()


def from_wire(constraint_json: str, vocab_size: int, stop_token_ids: tuple[int, ...], load_tokenizer) -> "GrammarState":
    """`wire_form`'s request at a tier of a distributed chain: compiled over the tokenizer it names, read by
    `load_tokenizer(source)` (one book per tokenizer, vocabulary and stop tokens in this process, so equal
    constraints share the compiler's cache)."""
    fields = json.loads(constraint_json)
    key = (fields["tokenizer"], vocab_size, tuple(sorted(stop_token_ids)))
    with _BOOKS_LOCK:
        book = _BOOKS.get(key)
        if book is None:
            if not fields["tokenizer"]:
                raise RequestError("structured output on a distributed chain needs the target's tokenizer folder")
            tokenizer = load_tokenizer(fields["tokenizer"])
            book = _BOOKS[key] = GrammarBook(tokenizer, vocab_size, tuple(stop_token_ids), fields["tokenizer"])
    spec = ConstraintSpec(fields["kind"], fields["source"], bool(fields.get("strict", True)))
    return book.start(book.compile(spec), int(fields["prompt_len"]))


def check_source(spec: ConstraintSpec) -> None:
    """Parse `spec`'s source without a tokenizer (no model needed): the command line refuses a bad schema, regex or
    grammar file in one line before the models load. Raises RequestError; the engine's compile stays the judge."""
    xgrammar = _xgrammar()
    try:
        if spec.kind == "json_schema":
            xgrammar.Grammar.from_json_schema(spec.source, **_schema_options(spec))
        elif spec.kind == "regex":
            xgrammar.Grammar.from_regex(spec.source)
        else:
            xgrammar.Grammar.from_ebnf(spec.source)
    except Exception as exc:  # noqa: BLE001 - xgrammar's parse errors (RuntimeError, ValueError, its own types)
        raise RequestError(f"invalid {spec.kind}: {one_line(exc)}") from None


def _schema_options(spec: ConstraintSpec) -> dict:
    """How a JSON schema becomes a grammar, the same for the command line's check and the engine's compile: no free
    whitespace between tokens (a model may not pad its JSON forever; ", " and ": " separate), and `strict`."""
    return {"any_whitespace": False, "strict_mode": spec.strict}


def _compile(compiler, spec: ConstraintSpec):
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(spec.source, **_schema_options(spec))
    if spec.kind == "regex":
        return compiler.compile_regex(spec.source)
    return compiler.compile_grammar(spec.source)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's bitmask words [..., W] int32 (bit j of word i: token 32 i + j is allowed) -> [..., vocab_size] bool,
    on the words' device. On the CPU numpy's unpackbits over the words' little-endian bytes (~30 µs at 151,936
    tokens; torch's shifts ~120 µs); elsewhere the shifts, on the device."""
    if bitmask.device.type == "cpu" and sys.byteorder == "little":
        as_bytes = bitmask.contiguous().numpy().view(np.uint8)  # [..., 4 W]
        unpacked = np.unpackbits(as_bytes, axis=-1, bitorder="little")[..., :vocab_size]  # [..., V] uint8
        return torch.from_numpy(unpacked.view(np.bool_))
    return unpack_by_shifts(bitmask, vocab_size)


def unpack_by_shifts(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """`unpack_bitmask` in torch ops on the words' own device (a device tier's logits: no copy to the host)."""
    bits = (bitmask[..., :, None] >> _BIT_SHIFTS.to(bitmask.device)) & 1  # [..., W, 32]
    return bits.flatten(-2)[..., :vocab_size].bool()


class GrammarState:
    """One request's grammar: its matcher, which advances over a context's tokens past the prompt and rolls
    back to the prefix the next context shares, and its masks (packed words), cached per position (the tiers
    of the request share them). Not thread-safe: the round's one thread calls it."""

    def __init__(self, spec: ConstraintSpec, prompt_len: int, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        xgrammar = _xgrammar()
        self.spec = spec
        self.prompt_len = prompt_len
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self.matcher = xgrammar.GrammarMatcher(spec.compiled)
        self._bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)  # [1, W] int32
        self.consumed: list[int] = []  # the generated tokens the matcher has accepted, in order
        self.masks: dict[tuple[int, ...], torch.Tensor | None] = {}  # generated tokens -> packed words [W] (None: free)
        self.dead_ends: set[tuple[int, ...]] = set()  # positions where nothing (not even an end) is allowed
        self.mask_fills = 0  # masks computed (each position once)
        self.tokenizer_source: str | None = None  # where the tokenizer loads from (`wire_form`)

    def _goto(self, generated: list[int]) -> bool:
        """Put the matcher after `generated`; False when the grammar refuses one of them (or a token after an end)."""
        keep = common_prefix(self.consumed, generated)
        if keep < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - keep)
            del self.consumed[keep:]
        for token in generated[keep:]:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(token)):
                return False
            self.consumed.append(int(token))
        return True

    def words(self, context: list[int]) -> torch.Tensor | None:
        """[W] int32, xgrammar's packed mask of the tokens the grammar allows after `context` (the prompt, then
        generated tokens); None where no row there is ever used (the grammar refused a token before, or ended)."""
        key = tuple(context[self.prompt_len:])
        if key in self.masks:
            return self.masks[key]
        words = None
        if self._goto(list(key)) and not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(self._bitmask)
            self.mask_fills += 1
            words = self._bitmask[0].clone()
            if not unpack_bitmask(words, self.vocab_size).numpy().any():  # the tokenizer cannot continue: end here, say why
                self.dead_ends.add(key)
                for token in self.stop_token_ids:
                    words[token >> 5] |= _bit(token)
        if len(self.masks) >= MASK_CACHE_POSITIONS:  # keep the newest positions (the committed prefix only grows)
            longest = max(len(k) for k in self.masks)
            self.masks = {k: v for k, v in self.masks.items() if len(k) > longest - MASK_CACHE_POSITIONS // 4}
        self.masks[key] = words
        return words

    def allowed(self, context: list[int]) -> torch.Tensor | None:
        """[V] bool: the tokens the grammar allows after `context`; None where no row is ever used (`words`)."""
        words = self.words(context)
        return None if words is None else unpack_bitmask(words, self.vocab_size)

    def accepts(self, context: list[int], token: int) -> bool:
        """Does the grammar allow `token` after `context`?"""
        words = self.words(context)
        return words is None or bool((int(words[token >> 5]) >> (token & 31)) & 1)

    def ended_unsatisfiable(self, generated: list[int]) -> bool:
        """Did a request that committed `generated` end where its grammar allowed no token?"""
        return tuple(generated[:-1]) in self.dead_ends or tuple(generated) in self.dead_ends


def _bit(token: int) -> int:
    """Token's bit in its int32 word (bit 31 as the negative int32 it is)."""
    bit = 1 << (token & 31)
    return bit - (1 << 32) if bit >= 1 << 31 else bit


# ------------------------------------------------------------------------ what the tiers call


def grammar_of(params):
    """A request's GrammarState (None when its output is free)."""
    return getattr(params, "grammar", None)


def restrict_rows(logits: torch.Tensor, grammar: GrammarState | None, prefixes: list[list[int]]) -> torch.Tensor:
    """`logits` [n, V] with row j's disallowed tokens (after `prefixes[j]`) at -inf; the rows unchanged
    without a grammar. The packed masks go to the logits' device and are unpacked there. A fresh tensor where
    anything is masked (the caller's rows may be a graph's buffers)."""
    if grammar is None:
        return logits
    assert logits.dim() == 2 and logits.shape[0] == len(prefixes), (logits.shape, len(prefixes))
    words = [grammar.words(prefix) for prefix in prefixes]
    if all(w is None for w in words):
        return logits
    free = torch.full_like(next(w for w in words if w is not None), -1)  # every bit set: a row nobody reads
    packed = torch.stack([free if w is None else w for w in words]).to(logits.device, non_blocking=True)  # [n, W]
    allowed = unpack_bitmask(packed, logits.shape[-1])  # [n, V]
    return logits.masked_fill(~allowed, float("-inf"))


def restrict_each(rows: torch.Tensor, params: list, prefix: Callable[[int], list[int]]) -> torch.Tensor:
    """Drafting rows [R, V] (row r after `prefix(r)`, of the request with `params[r]`) restricted by each
    request's grammar; the rows themselves when no request has one. `prefix` is asked only for constrained
    rows: a free request's context is never copied on the drafting path."""
    if all(grammar_of(p) is None for p in params):
        return rows
    return torch.cat([rows[r: r + 1] if grammar_of(p) is None else restrict_rows(rows[r: r + 1], grammar_of(p), [prefix(r)])
                      for r, p in enumerate(params)])


def restrict_blocks(scored: list[torch.Tensor], params: list, contexts: list[list[int]], blocks) -> list[torch.Tensor]:
    """Each request's scored rows [len(block) + 1, V] restricted by its grammar along its block of `blocks`
    (polyspec.workers.core.tree.Blocks; a tree's rows along each node's own path); a free request's rows
    unchanged, its prefixes never built."""
    return [rows if grammar_of(p) is None else restrict_rows(rows, grammar_of(p), tree_prefixes(context, blocks[r].tokens, blocks[r].parents))
            for r, (rows, p, context) in enumerate(zip(scored, params, contexts))]


def node_context(context: list[int], tokens: list[int], parents: list[int], node: int) -> list[int]:
    """`context` then the tokens on a tree's path from the root to `node` (inclusive)."""
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return context + path[::-1]


def tree_prefixes(context: list[int], tokens: list[int], parents: list[int]) -> list[list[int]]:
    """The context before each scored row of a block: the root (after `context`), then after each node
    (its path's tokens). A chain's parents are -1, 0, 1, ..."""
    paths: list[list[int]] = []
    for node, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else []) + [tokens[node]])
    return [context] + [context + path for path in paths]


def cut_at_disallowed(grammar: GrammarState | None, context: list[int], tokens: list[int]) -> list[int]:
    """A lookup's proposal `tokens` after `context`, cut before its first token the grammar refuses."""
    if grammar is None:
        return tokens
    for j, token in enumerate(tokens):
        if not grammar.accepts(context + tokens[:j], token):
            return tokens[:j]
    return tokens
