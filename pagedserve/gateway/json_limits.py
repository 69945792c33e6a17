"""Bounds on a JSON request body, checked on its bytes before it is parsed: how deeply arrays
and objects nest, and whether an integer is beyond 64 bits.

Why before: msgspec parses nesting recursively and raises `RecursionError` near the
interpreter's limit (about a thousand levels), and it gives integers of any size to `int`
and `Any` fields alike, which the queue's msgpack cannot carry and the worker's int64
columns cannot hold. Both are a 400 here, naming the top-level field that holds them.

The scan is vectorized (numpy over the body's bytes), so a body of megabytes costs
milliseconds: with the bytes inside strings masked out, the brackets give the depth at each
bracket by a prefix sum, and the runs of digits give the integer literals; only those of 19
digits or more may not fit in 64 bits.
"""

from __future__ import annotations

import re

import msgspec
import numpy as np

from pagedserve.common.errors import InvalidParameterError
from pagedserve.common.http_errors import InvalidBodyError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_ESCAPE = re.compile(rb"\\.", re.DOTALL)  # a backslash escape inside a string: \" \\ \n \u...
_QUOTE, _MINUS = ord('"'), ord("-")
_ZERO, _NINE = ord("0"), ord("9")
_OPENS, _CLOSES = (ord("["), ord("{")), (ord("]"), ord("}"))
_NOT_BEFORE_INTEGER = np.frombuffer(b".eE+", dtype=np.uint8)  # digits after these: a fraction or an exponent
_NOT_AFTER_INTEGER = np.frombuffer(b".eE", dtype=np.uint8)  # digits before these: a float
_INT64_DIGITS = len(str(INT64_MAX))  # 19: shorter literals always fit
_POWERS_OF_TEN = 10 ** np.arange(_INT64_DIGITS - 1, -1, -1, dtype=np.uint64)


class _BodyBytes:
    """The bytes of a JSON text with its strings masked out: where its brackets are, the depth
    after each, and where its integer literals are."""

    def __init__(self, body: bytes):
        # Escapes become two plain bytes: same length, and no escaped quote is left to confuse
        # where strings begin and end.
        self.data = np.frombuffer(_ESCAPE.sub(b"__", body), dtype=np.uint8)
        data = self.data
        # Outside strings: after an even number of quotes (a uint8 count keeps its parity).
        self.outside = (np.cumsum(data == _QUOTE, dtype=np.uint8) & 1) == 0
        is_open = ((data == _OPENS[0]) | (data == _OPENS[1])) & self.outside
        is_close = ((data == _CLOSES[0]) | (data == _CLOSES[1])) & self.outside
        self.brackets = np.flatnonzero(is_open | is_close)
        self.opens = is_open[self.brackets]
        self.depths = np.cumsum(np.where(self.opens, 1, -1), dtype=np.int64)

    def first_deeper_than(self, max_depth: int) -> int | None:
        """The position of the first bracket that opens a level beyond `max_depth`."""
        deep = np.flatnonzero(self.depths > max_depth)
        return int(self.brackets[deep[0]]) if deep.size else None

    def first_integer_beyond_int64(self) -> int | None:
        """The position of the first integer literal (its sign included) outside [INT64_MIN, INT64_MAX]."""
        data = self.data
        digit = np.zeros(len(data) + 2, dtype=bool)
        digit[1:-1] = (data >= _ZERO) & (data <= _NINE) & self.outside
        edges = np.flatnonzero(digit[1:] != digit[:-1])  # runs of digits: [start, end) pairs
        starts, ends = edges[0::2], edges[1::2]
        long = ends - starts >= _INT64_DIGITS
        starts, ends = starts[long], ends[long]
        if not starts.size:
            return None
        edge = np.zeros(1, dtype=np.uint8)
        padded = np.concatenate((edge, data, edge))  # padded[i + 1] is data[i]
        before, after = padded[starts], padded[ends + 1]
        negative = before == _MINUS
        exponent = negative & np.isin(padded[np.maximum(starts - 1, 0)], _NOT_BEFORE_INTEGER)  # 1e-...
        integer = ~np.isin(before, _NOT_BEFORE_INTEGER) & ~np.isin(after, _NOT_AFTER_INTEGER) & ~exponent
        starts, ends, negative = starts[integer], ends[integer], negative[integer]
        beyond = ends - starts > _INT64_DIGITS
        # 19 digits fit in a uint64: compare the value with the bound of its sign
        exact = np.flatnonzero(~beyond)
        if exact.size:
            windows = data[starts[exact, None] + np.arange(_INT64_DIGITS)].astype(np.uint64) - np.uint64(_ZERO)
            values = (windows * _POWERS_OF_TEN).sum(axis=1, dtype=np.uint64)
            bound = np.where(negative[exact], np.uint64(-INT64_MIN), np.uint64(INT64_MAX))
            beyond[exact] = values > bound
        offenders = np.flatnonzero(beyond)
        return int(starts[offenders[0]]) - int(negative[offenders[0]]) if offenders.size else None

    def depth_at(self, position: int) -> int:
        """The nesting depth of the byte at `position` (the body's own object is depth 1)."""
        before = int(np.searchsorted(self.brackets, position)) - 1
        return int(self.depths[before]) if before >= 0 else 0

    def member_start(self, position: int) -> int:
        """Where the value of the top-level member holding `position` begins: `position`
        itself when it is at depth 1, else the bracket that opened depth 2 last before it."""
        if self.depth_at(position) <= 1:
            return position
        before = int(np.searchsorted(self.brackets, position))
        opened_2 = np.flatnonzero((self.depths[:before] == 2) & self.opens[:before])
        return int(self.brackets[opened_2[-1]])


def check_json_body(body: bytes, max_depth: int) -> None:
    """Raise a 400 when `body` nests deeper than `max_depth` levels (its own object is the
    first) or holds an integer beyond 64 bits. Anything else wrong with it is the parser's."""
    scan = _BodyBytes(body)
    if (position := scan.first_deeper_than(max_depth)) is not None:
        _raise_at(body, scan, position, f"nests arrays and objects more than {max_depth} levels deep")
    if (position := scan.first_integer_beyond_int64()) is not None:
        _raise_at(body, scan, position, f"holds an integer outside the 64-bit range [{INT64_MIN}, {INT64_MAX}]")


def _raise_at(body: bytes, scan: _BodyBytes, position: int, message: str):
    """Raise the error for what is at `position`, naming the top-level field that holds it."""
    field = _top_level_field(body, scan.member_start(position))
    if field is None:
        raise InvalidBodyError(f"the request body {message}")
    raise InvalidParameterError(field, message)


def _top_level_field(body: bytes, value_start: int) -> str | None:
    """The name of the top-level member whose value begins at `value_start`: the body up to
    there, closed with a value (`0}`), is a shallow object whose last key is that name."""
    try:  # the values stay raw bytes: only the keys are made
        prefix = msgspec.json.decode(body[:value_start] + b"0}", type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    return next(reversed(prefix)) if prefix else None
