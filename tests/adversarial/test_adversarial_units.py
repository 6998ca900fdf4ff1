"""The pieces under the adversarial tests, alone: strict JSON, the log rate limit, the limit settings."""
from __future__ import annotations

import logging

import pytest

from rtc_agent.config import build_settings
from rtc_agent.server import json_input
from rtc_agent.server.errors import ProtocolError
from rtc_agent.server.guard import bearer
from rtc_agent.server.limits import RateLimit


@pytest.mark.parametrize("text, depth", [("{}", 1), ('[{"a": [1]}]', 3), ('["[[[[", "}}"]', 1), ("1", 0),
                                         ('{"a": "\\"[["}', 1)])
def test_nesting_depth_skips_brackets_inside_strings(text: str, depth: int) -> None:
    assert json_input.nesting_depth(text) == depth


@pytest.mark.parametrize("text", ["[" * 65 + "]" * 65, "NaN", '{"a": -Infinity}', b"\xff", "{", "[1,]"])
def test_strict_json_refuses_with_invalid_json(text: str | bytes) -> None:
    with pytest.raises(ProtocolError) as refused:
        json_input.loads(text)
    assert refused.value.code == "invalid_json"


def test_strict_json_reads_what_json_reads() -> None:
    assert json_input.loads("[" * 64 + "]" * 64) is not None
    assert json_input.loads('{"s": "\\u00e9", "n": 12, "f": 0.5}') == {"s": "\u00e9", "n": 12, "f": 0.5}


def test_the_log_rate_limit_lets_a_burst_through_then_counts_what_it_dropped() -> None:
    limit = RateLimit(burst=3, window_s=3600)
    records = [logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "bad request from %s", ("x",), None)
               for _ in range(10)]
    assert [limit.filter(r) for r in records] == [True] * 3 + [False] * 7
    other = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "another message", (), None)
    assert limit.filter(other)  # each message has its own budget
    limit.window_s = 0.0  # the next window: the first record says how many were dropped
    record = records[0]
    assert limit.filter(record) and "7 more like this" in record.getMessage()


def test_limit_settings_come_from_flags_env_and_file(tmp_path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('idle_timeout_s = 120\nallowed_origins = ["https://a.example", "https://b.example"]\n')
    s = build_settings({"max_call_s": 900.0}, env={"RTC_AGENT_MAX_CONNECTIONS": "64"}, config_file=str(config))
    assert (s.idle_timeout_s, s.max_call_s, s.max_connections) == (120.0, 900.0, 64)
    assert s.allowed_origins == ("https://a.example", "https://b.example")
    with pytest.raises(ValueError):
        build_settings({"idle_timeout_s": -1.0}, env={})


@pytest.mark.parametrize("header, credentials", [("Bearer s3cret", "s3cret"), ("bearer s3cret", "s3cret"),
                                                 ("BEARER  s3cret", "s3cret"), ("Basic s3cret", ""),
                                                 ("Bearers3cret", ""), ("s3cret", ""), ("", "")])
def test_the_bearer_scheme_is_read_in_any_case(header: str, credentials: str) -> None:
    assert bearer(header) == credentials
