"""``--endpoint`` clients read each streamed chunk through one function: any JSON of another shape is "a malformed
event" (``{"choices": "x"}`` ended in ``internal error: AttributeError``), an ``{"error": ...}`` event is the
server's message; and ``--timeout`` / ``LOCALDIFF_TIMEOUT`` past a year are refused up front (1e10 s overflowed the
socket deadline: ``internal error: OverflowError``)."""

from __future__ import annotations

import argparse

import pytest

from localdiff.backends.remote import _event_parts
from localdiff.cli.remote import MAX_TIMEOUT_S, endpoint_timeout
from localdiff.errors import UsageError


@pytest.mark.parametrize("chunk", [{"choices": "x"}, {"choices": [1]}, {"choices": [{"delta": 3}]}, [], "xerror"])
def test_a_chunk_of_another_shape_is_malformed(chunk):
    with pytest.raises((AttributeError, TypeError)):
        _event_parts(chunk, True, {})


def test_chunk_parts_and_the_servers_error():
    info: dict = {}
    chunk = {"choices": [{"delta": {"content": "hi"}, "finish_reason": "stop"}], "usage": {"total_tokens": 3}}
    assert _event_parts(chunk, True, info) == [("text", "hi")]
    assert info["finish_reason"] == "stop" and info["usage"] == {"total_tokens": 3}
    assert _event_parts({"choices": [{"text": "x"}]}, False, {}) == [("text", "x")]
    assert _event_parts({"error": {"message": "model not found"}}, True, {}) == "model not found"


@pytest.mark.parametrize("value", ["1e10", "99999999999", "1e300"])
def test_a_timeout_past_a_year_is_refused(value, monkeypatch):
    with pytest.raises(UsageError, match=r"^--timeout: at most 31,536,000 seconds"):
        endpoint_timeout(argparse.Namespace(timeout=value))
    monkeypatch.setenv("LOCALDIFF_TIMEOUT", value)
    with pytest.raises(UsageError, match=r"^LOCALDIFF_TIMEOUT: at most"):
        endpoint_timeout(argparse.Namespace(timeout=None))
    assert endpoint_timeout(argparse.Namespace(timeout=str(MAX_TIMEOUT_S))) == MAX_TIMEOUT_S
