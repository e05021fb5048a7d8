"""Untrusted bytes → JSON or a reason: the three kinds of line that used to kill collect, and the line reader."""

from __future__ import annotations

import io
import json

from kiln.tasks.data.untrusted import MAX_DEPTH, has_surrogates, parse_json, read_lines, repair_surrogates


def test_a_number_past_pythons_digit_limit_is_a_reason_not_a_valueerror():
    value, problem = parse_json('{"text": "x", "n": ' + "9" * 5000 + "}")
    assert value is None and problem.reason == "json_number_out_of_range"
    assert "4300" in problem.detail  # Python's own message names its limit
    # Within Python's limit but past orjson's 64 bits (which the later stages read with): refused too.
    assert parse_json('{"n": 18446744073709551616}')[1].reason == "json_number_out_of_range"
    assert parse_json('{"n": 18446744073709551615}')[1] is None  # u64 max is fine
    assert parse_json('{"n": 1e400}')[1].reason == "json_number_out_of_range"  # inf
    assert parse_json('{"n": NaN}')[1].reason == "invalid_json"  # Python's extension, not JSON


def test_nesting_past_the_parser_or_the_portable_limit_is_a_reason_not_a_recursionerror():
    value, problem = parse_json("[" * 100_000 + "]" * 100_000)
    assert value is None and problem.reason == "json_too_deep"
    depth_ok = "[" * (MAX_DEPTH - 1) + "{}" + "]" * (MAX_DEPTH - 1)
    assert parse_json(depth_ok)[1] is None
    assert parse_json("[" + depth_ok + "]")[1].reason == "json_too_deep"


def test_lone_surrogates_are_replaced_and_counted_and_pairs_are_kept():
    line = json.dumps({"text": "a\ud800b", "metadata": {"k\udfff": ["\ud83d"], "ok": "\U0001f600"}})
    assert has_surrogates(line)
    value, problem = parse_json(line)
    assert problem is None
    fixed, count = repair_surrogates(value)
    assert fixed == {"text": "a\ufffdb", "metadata": {"k\ufffd": ["\ufffd"], "ok": "\U0001f600"}}
    assert count == 3
    json.dumps(fixed, ensure_ascii=False).encode("utf-8")  # writable now
    assert not has_surrogates(json.dumps({"text": "caf\u00e9 \U0001f600"}, ensure_ascii=False))


def test_read_lines_bounds_memory_and_numbers_every_line():
    data = b'{"a": 1}\n' + b"x" * 50 + b"\n\n" + b"y" * 10 + b"\n" + b"z" * 30  # last line has no newline
    lines = list(read_lines(io.BytesIO(data), max_bytes=20))
    assert [(line.number, line.data, line.size) for line in lines] == [
        (1, b'{"a": 1}\n', 9), (2, None, 51), (3, b"\n", 1), (4, b"y" * 10 + b"\n", 11), (5, None, 30),
    ]
    assert lines[1].prefix.startswith(b"xxx")
    # Exactly the limit, plus its newline, is not too large.
    assert [line.data for line in read_lines(io.BytesIO(b"a" * 20 + b"\nb"), max_bytes=20)] == [b"a" * 20 + b"\n", b"b"]
