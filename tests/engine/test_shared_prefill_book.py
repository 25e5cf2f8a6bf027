"""``SharedPrefill`` on its own (``afm_core._engine.shared_prefill``): who
leads a prompt's prefill, who is parked on whom, and what happens to parked
jobs when their leader's prefill ends or the leader leaves.  The worker-level
behaviour (copies of the cache, the computed tokens) is in test_shared_prefill."""

from __future__ import annotations

from typing import Any

from afm_core import ChatRequest
from afm_core._engine.commands import Job, JobKey, MlxUid
from afm_core._engine.shared_prefill import SharedPrefill, share_key

REQ = ChatRequest.from_openai({"messages": [{"role": "user", "content": "hi"}]})


def job(key: int, prompt: list[int], *, uid: int | None = None, adapter: int = 0, **kw: Any) -> Job:
    j = Job(key=JobKey(key), request=REQ, prompt=prompt, max_tokens=4, pipeline=None,  # type: ignore[arg-type]
            adapter=adapter, **kw)
    j.uid = MlxUid(uid) if uid is not None else None
    return j


def book() -> tuple[SharedPrefill, set[int]]:
    shared: set[int] = set()
    return SharedPrefill(lambda: shared), shared


def test_the_share_key_is_the_adapter_then_the_prompt() -> None:
    assert share_key(job(1, [5, 6, 7])) == (0, 5, 6, 7)
    assert share_key(job(1, [5, 6, 7], adapter=2)) == (2, 5, 6, 7)
    assert share_key(job(1, [5])) is None  # nothing to share
    assert share_key(job(1, [5, 6, 7], prompt_top_logprobs=0)) is None  # scoring needs its own prefill


def test_a_job_parks_on_the_leader_of_its_prompt_only() -> None:
    prefill, shared = book()
    assert not prefill.park(job(2, [1, 2, 3]))  # nobody leads it yet
    leader = job(1, [1, 2, 3], uid=10)
    prefill.lead(leader)
    assert prefill.leading == {JobKey(1): (0, 1, 2, 3)}
    assert not prefill.park(job(3, [1, 2, 4]))  # another prompt
    assert not prefill.park(job(4, [1, 2, 3], adapter=1))  # another adapter's cache
    assert not prefill.park(job(5, [1, 2, 3], prompt_top_logprobs=1))
    follower = job(2, [1, 2, 3])
    assert prefill.park(follower)
    assert follower.leader is leader and leader.followers == [follower]
    assert shared == {10}  # the generator keeps the leader's prefilled cache
    assert prefill.parked == 1


def test_a_second_job_with_the_prompt_does_not_take_the_lead() -> None:
    prefill, _ = book()
    first, second = job(1, [1, 2, 3], uid=10), job(2, [1, 2, 3], uid=11)
    prefill.lead(first)
    prefill.lead(second)
    assert prefill.leaders[(0, 1, 2, 3)] is first and JobKey(2) not in prefill.leading


def test_a_leader_not_yet_in_the_batch_takes_no_followers() -> None:
    prefill, shared = book()
    prefill.lead(job(1, [1, 2, 3]))  # no uid yet
    assert not prefill.park(job(2, [1, 2, 3])) and not shared


def test_the_followers_are_handed_over_once_when_the_prefill_ends() -> None:
    prefill, shared = book()
    leader = job(1, [1, 2, 3], uid=10)
    prefill.lead(leader)
    parked = [job(k, [1, 2, 3]) for k in (2, 3)]
    for p in parked:
        assert prefill.park(p)
    assert prefill.followers(leader) == parked
    assert all(p.leader is None for p in parked) and not leader.followers
    assert prefill.followers(leader) == []
    prefill.ended(leader)
    assert not prefill.leaders and not prefill.leading and not prefill.orphans
    assert not shared and prefill.parked == 0


def test_a_leader_leaving_early_orphans_its_followers_in_order() -> None:
    prefill, shared = book()
    leader = job(1, [1, 2, 3], uid=10)
    prefill.lead(leader)
    parked = [job(k, [1, 2, 3]) for k in (2, 3, 4)]
    for p in parked:
        prefill.park(p)
    prefill.leave(leader)
    assert not prefill.leaders and not shared
    assert all(p.leader is None for p in parked)
    assert [prefill.orphan(), prefill.orphan(), prefill.orphan()] == parked
    assert prefill.orphan() is None


def test_a_follower_leaving_frees_the_leader_s_cache_when_it_was_the_last() -> None:
    prefill, shared = book()
    leader = job(1, [1, 2, 3], uid=10)
    prefill.lead(leader)
    a, b = job(2, [1, 2, 3]), job(3, [1, 2, 3])
    prefill.park(a)
    prefill.park(b)
    prefill.leave(a)
    assert leader.followers == [b] and a.leader is None and shared == {10}
    prefill.leave(b)
    assert not leader.followers and not shared
    assert prefill.leaders[(0, 1, 2, 3)] is leader  # still prefilling: later jobs may park


def test_an_orphan_that_leaves_is_not_admitted_again() -> None:
    prefill, _ = book()
    leader = job(1, [1, 2, 3], uid=10)
    prefill.lead(leader)
    a = job(2, [1, 2, 3])
    prefill.park(a)
    prefill.ended(leader)
    assert prefill.orphans == {JobKey(2): a}
    prefill.leave(a)  # cancelled before it was admitted again
    assert prefill.orphan() is None
