"""Server-sent events stay one line each, whatever text a model generates."""

from __future__ import annotations

import json

from pagedserve.gateway.responses import sse_event


def test_an_event_is_one_line_for_every_line_reader():
    text = "a\u2028b\u2029c\u0085d\ne\rf\x0bg\x1ch"
    event = sse_event({"choices": [{"text": text}]})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    line = event[len(b"data: "):-2].decode()
    assert line.splitlines() == [line]  # str.splitlines (httpx's aiter_lines) sees one line
    assert json.loads(line)["choices"][0]["text"] == text
