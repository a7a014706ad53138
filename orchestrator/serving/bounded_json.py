"""JSON from a client, parsed within bounds that keep one request from holding the server.

`json.loads` is C code that keeps the interpreter lock for its whole run and makes one
Python object per value, so its cost is the input's bytes plus, above all, its arrays and
objects (8 MiB of 30-deep nested arrays: four million lists, about two seconds and over a
gigabyte). `loads_bounded` therefore measures the input before parsing it (`measure`), with a
handful of C-speed passes over the bytes and no Python loop over the input: its size; with
escapes blanked and strings dropped, its colons (members) and commas (values); then its
brackets alone (the skeleton, e.g. b"[{}[]]"): how many arrays and objects, and how deep,
read from at most the first 2 * MAX_CONTAINERS of them. Lone surrogates (`"\\ud800"`) are
looked for only when the bytes hold such an escape. Every refusal is a `JsonRefused` with one
line and the HTTP status it deserves (400 malformed or too deep, 413 too large or too many).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
import re

MAX_JSON_DEPTH = 32  # arrays and objects inside one another
MAX_CONTAINERS = 10_000  # arrays and objects in one document (a request with 1024 chat messages holds ~1030)
MAX_MEMBERS = 10_000  # object members (key: value pairs) in one document
MAX_VALUES = 500_000  # values in one document (e.g. token ids: 64 prompts of ~7,800)
_STRING = re.compile(rb'"[^"]*"')  # after escapes are blanked, a string is a quote, no quote, a quote
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class JsonRefused(ValueError):
    """A client's JSON that is not taken: `status` 400 (malformed, nested too deep) or 413 (too large)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def without_strings(raw: bytes) -> bytes:
    """`raw` with every JSON string removed (C-speed passes only)."""
    blanked = raw.replace(b"\\\\", b"__").replace(b'\\"', b"__")  # backslashes pair left to right, as JSON reads them
    return _STRING.sub(b"", blanked)


def deepest(brackets: bytes, limit: int) -> int:
    """The deepest nesting of `brackets`, stopping at the first level past `limit`."""
    depth = deepest_seen = 0
    for byte in brackets:
        if byte in b"[{":
            depth += 1
            if depth > limit:
                return depth
            deepest_seen = max(deepest_seen, depth)
        else:
            depth -= 1
    return deepest_seen


def measure(raw: bytes, what: str, max_bytes: int) -> None:
    """JsonRefused unless `raw` is within every bound; cheap whatever `raw` holds."""
    if len(raw) > max_bytes:
        raise JsonRefused(f"{what} has {len(raw)} bytes (at most {max_bytes})", 413)
    structure = without_strings(raw)
    members = structure.count(b":")
    if members > MAX_MEMBERS:
        raise JsonRefused(f"{what} holds {members} object members (at most {MAX_MEMBERS})", 413)
    values = structure.count(b",") + 1
    if values > MAX_VALUES:
        raise JsonRefused(f"{what} holds {values} JSON values (at most {MAX_VALUES})", 413)
    brackets = structure.translate(None, _NOT_BRACKETS)
    containers = brackets.count(b"[") + brackets.count(b"{")
    if deepest(brackets[: 2 * MAX_CONTAINERS + 2], MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise JsonRefused(f"malformed JSON in {what}: nested deeper than {MAX_JSON_DEPTH} levels")
    if containers > MAX_CONTAINERS:
        raise JsonRefused(f"{what} holds {containers} JSON arrays and objects (at most {MAX_CONTAINERS})", 413)


def loads_bounded(raw: bytes | str, what: str, max_bytes: int):
    """`raw` parsed, or JsonRefused with one line naming `what` (e.g. "the request body")."""
    if isinstance(raw, str):
        if len(raw) > max_bytes:  # characters <= bytes: refused before encoding a huge string
            raise JsonRefused(f"{what} has {len(raw)} characters (at most {max_bytes} bytes)", 413)
        raw = raw.encode("utf-8", "surrogatepass")
    measure(raw, what, max_bytes)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JsonRefused(f"{what} is not valid UTF-8 (byte {exc.start})") from None
    try:
        value = json.loads(text)
    except RecursionError:  # cannot happen within MAX_JSON_DEPTH; kept as a one-line answer all the same
        raise JsonRefused(f"malformed JSON in {what}: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        raise JsonRefused(f"malformed JSON in {what}: {str(exc).splitlines()[0][:200]}") from None
    if _SURROGATE_ESCAPE.search(raw) and _has_lone_surrogate(value):
        raise JsonRefused(f"a string in {what} holds a lone surrogate (\\ud800-\\udfff): not valid Unicode text")
    return value


def _has_lone_surrogate(value) -> bool:
    """Any string (key or value) of `value` that is not valid Unicode; iterative (the depth is bounded anyway)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


LARGE_REQUEST_BYTES = 1 << 20  # after a request this large, `return_memory_soon`
TRIM_DELAY_S = 1.0  # after the request's objects are gone (its handler has returned)
_LIBC = None
_trim_scheduled = False


def return_memory() -> None:
    """Give freed heap pages back to the system (glibc's malloc_trim), after a large request is
    done with: Python frees its objects, but glibc keeps the pages for reuse, and the process
    would stay as large as the largest request it ever read. A no-op without glibc."""
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            _LIBC = ctypes.CDLL(name) if name else False
        except OSError:
            _LIBC = False
    trim = getattr(_LIBC, "malloc_trim", None) if _LIBC else None
    if trim is not None:
        trim(0)


def return_memory_soon() -> None:
    """`return_memory` on a worker thread TRIM_DELAY_S from now (once, however many large requests
    ask meanwhile): by then the request that asked, and what was made from it, are freed. Call
    it from the event loop."""
    global _trim_scheduled
    if _trim_scheduled:
        return
    _trim_scheduled = True
    loop = asyncio.get_running_loop()

    def trim() -> None:
        global _trim_scheduled
        _trim_scheduled = False
        loop.run_in_executor(None, return_memory)

    loop.call_later(TRIM_DELAY_S, trim)
