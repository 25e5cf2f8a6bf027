"""The pure model-residency bookkeeping (afm_http._residency): TTL, LRU, budget, keep_alive."""

from __future__ import annotations

import math

import pytest

from afm_http._residency import FOREVER, ModelTable, parse_keep_alive


@pytest.mark.parametrize(("value", "seconds"), [
    (0, 0.0), (10, 10.0), (2.5, 2.5), ("0", 0.0), ("30", 30.0), ("5m", 300.0), ("1h30m", 5400.0),
    ("1.5s", 1.5), ("250ms", 0.25), ("-1", FOREVER), (-1, FOREVER), ("-5m", FOREVER), (" 10s ", 10.0),
])
def test_keep_alive_values(value: object, seconds: float) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", [True, None, [], {}, "soon", "", "5 m", "m", "5d", math.nan, math.inf, "1e999"])
def test_keep_alive_refuses(value: object) -> None:
    with pytest.raises(ValueError):
        parse_keep_alive(value)


def _loaded(table: ModelTable, model_id: str, now: float) -> None:
    assert table.plan_load(model_id) == []
    table.begin_load(model_id)
    table.loaded(model_id, now, 0.5)


def test_idle_ttl_starts_when_the_last_request_ends() -> None:
    table = ModelTable([("a", 10)], keep_alive=5.0)
    table.acquire("a", 0.0)
    table.acquire("a", 0.0)
    _loaded(table, "a", 1.0)
    assert table.next_expiry() is None  # busy: no TTL
    table.release("a", 2.0)
    assert table.next_expiry() is None and table.expired(100.0) == []  # one request still holds it
    table.release("a", 3.0)
    assert table.next_expiry() == 8.0
    assert table.expired(7.9) == [] and table.expired(8.0) == ["a"]
    table.acquire("a", 7.0)  # a new request stops the clock
    assert table.next_expiry() is None and table.expired(100.0) == []
    table.release("a", 9.0)
    assert table.expired(14.0) == ["a"]
    table.begin_unload("a", "idle")
    assert table["a"].state == "unloading" and table.expired(100.0) == []
    table.unloaded("a")
    assert table["a"].state == "unloaded" and table["a"].unloads["idle"] == 1


def test_a_request_keep_alive_overrides_the_default_until_the_next() -> None:
    table = ModelTable([("a", 10)], keep_alive=300.0)
    table.acquire("a", 0.0)
    _loaded(table, "a", 0.0)
    table.release("a", 1.0, keep_alive=0.0)
    assert table.expired(1.0) == ["a"]  # 0: unload right after
    table.acquire("a", 1.0)
    table.release("a", 2.0, keep_alive=FOREVER)
    assert table.next_expiry() is None and table.expired(1e12) == []  # negative: never
    table.acquire("a", 3.0)
    table.release("a", 4.0)  # no keep_alive: the default again
    assert table.next_expiry() == 304.0


def test_a_load_that_ends_after_its_requests_left_starts_the_ttl() -> None:
    table = ModelTable([("a", 10)], keep_alive=5.0)
    table.acquire("a", 0.0)
    table.begin_load("a")
    table.release("a", 1.0)  # the client left while the model loaded
    assert table.next_expiry() is None
    table.loaded("a", 2.0, 2.0, size=12)
    assert table.next_expiry() == 7.0
    assert (table["a"].size, table["a"].loads, table["a"].load_seconds) == (12, 1, 2.0)


def test_budget_evicts_the_least_recently_used_idle_models() -> None:
    table = ModelTable([("a", 40), ("b", 40), ("c", 40), ("d", 70)], keep_alive=FOREVER, max_bytes=100)
    for t, m in enumerate("ab"):
        table.acquire(m, float(t))
        _loaded(table, m, float(t))
        table.release(m, float(t))
    assert table.resident_bytes() == 80
    table.acquire("a", 5.0)  # a is now the more recently used
    table.release("a", 6.0)
    assert table.plan_load("c") == ["b"]
    assert table.plan_load("d") == ["b", "a"]  # needs both, oldest first
    table.begin_unload("b", "evicted")
    table.begin_load("c")
    assert table.resident_bytes() == 120  # an unloading model still counts until it is gone
    table.unloaded("b")
    assert table.resident_bytes() == 80 and table["b"].unloads["evicted"] == 1


def test_budget_never_evicts_a_model_with_requests_and_waits_instead() -> None:
    table = ModelTable([("a", 60), ("b", 60)], max_bytes=100)
    table.acquire("a", 0.0)
    _loaded(table, "a", 0.0)  # a streams: held
    table.acquire("b", 1.0)
    assert table.plan_load("b") is None  # wait for room
    with pytest.raises(RuntimeError):
        table.begin_unload("a", "evicted")
    table.release("a", 2.0)
    assert table.plan_load("b") == ["a"]


def test_loading_and_unloading_models_count_and_are_never_victims() -> None:
    table = ModelTable([("a", 60), ("b", 60), ("c", 10)], max_bytes=100)
    table.acquire("a", 0.0)
    table.begin_load("a")
    assert table.plan_load("b") is None  # a is loading (its request waits for it)
    assert table.plan_load("c") == []  # 70 fits


def test_a_model_above_the_budget_loads_alone() -> None:
    table = ModelTable([("small", 10), ("huge", 500)], max_bytes=100)
    _loaded(table, "small", 0.0)
    assert table.plan_load("huge") == ["small"]
    table.begin_unload("small", "evicted")
    table.unloaded("small")
    assert table.plan_load("huge") == []


def test_no_budget_never_evicts() -> None:
    table = ModelTable([("a", 10**12), ("b", 10**12)])
    _loaded(table, "a", 0.0)
    assert table.plan_load("b") == []


def test_misuse_is_an_error() -> None:
    with pytest.raises(ValueError):
        ModelTable([("a", 1), ("a", 2)])
    table = ModelTable([("a", 1)])
    with pytest.raises(RuntimeError):
        table.release("a", 0.0)
    table.acquire("a", 0.0)
    table.begin_load("a")
    with pytest.raises(RuntimeError):
        table.begin_load("a")
    with pytest.raises(RuntimeError):
        table.plan_load("a")
    table.load_failed("a")
    assert table["a"].state == "unloaded" and table["a"].load_failures == 1
