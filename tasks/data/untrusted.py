"""Untrusted input bytes → JSON values or a quarantine reason, never an exception.

The collect stage reads files that anyone may have written. Python's `json` raises more than
`JSONDecodeError` on them: `ValueError` for integers past its 4300-digit limit and
`RecursionError` for deep nesting; it also accepts `NaN`/`Infinity` (not JSON), and it decodes
`"\\ud800"` into a lone surrogate that cannot be written back as UTF-8. The later stages read
Kiln's own files with orjson (through datatrove), which refuses integers outside 64 bits,
non-finite floats and deep nesting. So a record is accepted only as *portable JSON*: every
limit below is checked here, at the edge, and a record past one is quarantined with the reason,
instead of killing this stage or silently vanishing in a later one.

Lone surrogates are repaired (each becomes U+FFFD) rather than quarantined: they come from
producers that split a UTF-16 pair (JavaScript slicing, truncated fields) and usually damage one
character of an otherwise good document; UTF-8 decoders do the same with a bad byte. Repairs
are counted in the stage's stats.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

# Nesting depth of one record (the record itself is depth 1). orjson refuses past 255 levels on
# read; Kiln's stages wrap a record's metadata in two more levels, and real metadata needs few.
MAX_DEPTH = 64
# orjson's integer range (i64 minimum to u64 maximum).
MIN_INT, MAX_INT = -(2**63), 2**64 - 1
_JSON_WHITESPACE = b" \t\r\n"
_SURROGATE = re.compile("[\ud800-\udfff]")
_CHUNK = 1 << 20
RAW_PREFIX_CHARS = 1000  # what quarantine keeps of an input too large to copy


@dataclass(frozen=True)
class Problem:
    """Why an input cannot become a document: a quarantine reason and a human-readable detail."""

    reason: str
    detail: str = ""


@dataclass(frozen=True)
class Line:
    """One line of a file: its number, its bytes (None when longer than the limit), its size."""

    number: int
    data: bytes | None
    size: int
    prefix: bytes = b""  # the first bytes of a line that was too long


def read_lines(handle: BinaryIO, max_bytes: int) -> Iterator[Line]:
    """The lines of `handle`, never holding more than `max_bytes` (+ a chunk) of one line in memory.

    A line longer than `max_bytes` (its newline not counted) comes back with `data=None`: a file
    with no newline at all (a binary blob, one huge record) costs its size in reads, not memory.
    """
    number = 0
    while chunk := handle.readline(max_bytes + 1):
        number += 1
        content = len(chunk) - chunk.endswith(b"\n")
        if content <= max_bytes:
            yield Line(number, chunk, len(chunk))
            continue
        size, prefix = len(chunk), chunk[:RAW_PREFIX_CHARS]
        while not chunk.endswith(b"\n") and (chunk := handle.readline(_CHUNK)):
            size += len(chunk)
        yield Line(number, None, size, prefix)


def is_blank(data: bytes) -> bool:
    """A line of JSON whitespace only: no record (other bytes, even a form feed, are input)."""
    return not data.strip(_JSON_WHITESPACE)


class _NotJson(ValueError):
    """`NaN`, `Infinity` or `-Infinity`: Python's extensions, which no other JSON reader accepts."""


def _refuse_constant(name: str) -> Any:
    raise _NotJson(f"{name} is not JSON (RFC 8259 has no NaN or Infinity)")


def parse_json(text: str) -> tuple[Any, Problem | None]:
    """(value, None) or (None, problem) for one JSON text, whatever it holds."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except (json.JSONDecodeError, _NotJson) as err:
        return None, Problem("invalid_json", str(err))
    except RecursionError:
        return None, Problem("json_too_deep", f"nested deeper than Python's parser can follow (limit {MAX_DEPTH})")
    except ValueError as err:  # "Exceeds the limit (4300 digits) for integer string conversion"
        return None, Problem("json_number_out_of_range", str(err))
    problem = _portability_problem(value)
    return (None, problem) if problem else (value, None)


def _portability_problem(value: Any) -> Problem | None:
    """The first limit `value` breaks (depth, integer range, non-finite float), else None.

    Iterative, so that checking a deep value cannot itself overflow the stack.
    """
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                return Problem("json_too_deep", f"nested deeper than {MAX_DEPTH} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
        elif isinstance(item, bool) or item is None or isinstance(item, str):
            continue
        elif isinstance(item, int):
            if not MIN_INT <= item <= MAX_INT:
                return Problem("json_number_out_of_range", f"integer of {len(str(item))} digits is outside 64 bits")
        elif isinstance(item, float) and not math.isfinite(item):
            return Problem("json_number_out_of_range", f"number {item} overflows a 64-bit float")
    return None


def repair_surrogates(value: Any) -> tuple[Any, int]:
    """`value` with every lone surrogate in its strings (keys too) replaced by U+FFFD, and how
    many strings changed. Values are at most `MAX_DEPTH` deep (checked by `parse_json`)."""
    if isinstance(value, str):
        fixed, count = _SURROGATE.subn("\ufffd", value)
        return fixed, int(count > 0)
    if isinstance(value, list):
        pairs = [repair_surrogates(item) for item in value]
        return [item for item, _ in pairs], sum(n for _, n in pairs)
    if isinstance(value, dict):
        fixed_dict, total = {}, 0
        for key, item in value.items():
            new_key, n_key = repair_surrogates(key)
            new_item, n_item = repair_surrogates(item)
            fixed_dict[new_key] = new_item
            total += n_key + n_item
        return fixed_dict, total
    return value, 0


def has_surrogates(line: str) -> bool:
    """Whether a JSON text may decode to lone surrogates: only a `\\uD800`–`\\uDFFF` escape can make
    one (the text itself was decoded as strict UTF-8). A cheap test before `repair_surrogates`."""
    return "\\u" in line and re.search(r"\\u[dD][89a-fA-F]", line) is not None
