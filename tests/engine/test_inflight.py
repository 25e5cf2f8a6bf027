"""The Trio side's registry of requests in flight (``afm_core._engine.inflight``)
on its own: ids, job keys, groups and cancel by state."""

from __future__ import annotations

import pytest

from afm_core import DuplicateRequestError
from afm_core._engine.commands import JobKey, RequestState
from afm_core._engine.inflight import InFlight


def test_each_request_gets_a_new_key_and_its_id_once() -> None:
    reg = InFlight()
    a = reg.open("a")
    b = reg.open("b")
    assert (a.key, b.key) == (JobKey(1), JobKey(2)) and len(reg) == 2
    assert reg.by_id["a"] is a and reg.by_key[b.key] is b and a.state is RequestState.PREPARING
    with pytest.raises(DuplicateRequestError):
        reg.open("a")
    reg.close(a)
    assert "a" not in reg.by_id and a.key not in reg.by_key
    again = reg.open("a")  # the id is free again; the key is never reused
    assert again.key == JobKey(3)


def test_groups_are_kept_while_a_member_is_in_flight() -> None:
    reg = InFlight()
    own = reg.open("g", group="g")  # a request naming itself is in no group
    m1, m2 = reg.open("g/1", group="g"), reg.open("g/2", group="g")
    assert own.group is None and reg.groups == {"g": {"g/1", "g/2"}}
    reg.close(m1)
    assert reg.groups == {"g": {"g/2"}}
    reg.close(m2)
    assert reg.groups == {}


def test_cancel_ends_the_group_by_each_member_s_state() -> None:
    reg = InFlight()
    sent: list[JobKey] = []
    leader = reg.open("g")
    preparing = reg.open("g/1", group="g")
    submitted = reg.open("g/2", group="g")
    finished = reg.open("g/3", group="g")
    leader.state = submitted.state = RequestState.SUBMITTED
    finished.state = RequestState.FINISHED
    assert reg.cancel("g", sent.append)
    assert preparing.state is RequestState.CANCELLED  # ends once its preparation returns
    assert leader.state is submitted.state is RequestState.CANCELLING
    assert sent == [leader.key, submitted.key] and finished.state is RequestState.FINISHED
    assert not reg.cancel("g", sent.append)  # nothing left to cancel
    assert not reg.cancel("nobody", sent.append)


async def test_dispatch_delivers_a_step_and_times_the_first_token() -> None:
    from afm_core import ContentDelta, Finish, PromptProgress
    from afm_core._engine.commands import Delivery, PromptLogprobs

    reg = InFlight()
    a, b = reg.open("a"), reg.open("b")
    scored = PromptLogprobs(ids=(1, 2), tokens=("x", "y"), logprobs=(None, -0.5), top_logprobs=((), ()))
    reg.dispatch({a.key: Delivery((PromptProgress(1, 4, 0, 0.1),), False)})
    assert a.t_first is None and reg.ttft_count == 0  # progress is not a first token
    reg.dispatch({a.key: Delivery((ContentDelta("hi"),), False, scored),
                  b.key: Delivery((ContentDelta("yo"), Finish("stop")), True),
                  JobKey(99): Delivery((ContentDelta("late"),), True)})  # an ended request's: dropped
    assert a.t_first is not None and b.t_first is not None and reg.ttft_count == 2 and reg.ttft_sum >= 0
    assert a.prompt_logprobs is scored
    assert b.state is RequestState.FINISHED and b.mailbox.closed and not a.mailbox.closed
    assert await a.mailbox.take() == (PromptProgress(1, 4, 0, 0.1), ContentDelta("hi"))
    assert await b.mailbox.take() == (ContentDelta("yo"), Finish("stop"))
