"""The Trio side's requests in flight: each one's :class:`~.commands.RequestRecord`
by the client's request id and by the engine's job key (see :mod:`.commands`
for the id spaces), the groups whose members one cancel ends together, the
serial numbers that become job keys, and the delivery of each engine step's
events to their streams (with the time to first token).  Trio only; no MLX."""

from __future__ import annotations

import time
from collections.abc import Callable

from .._errors import DuplicateRequestError
from .._stream.events import PromptProgress
from .commands import JobKey, Outputs, RequestId, RequestRecord, RequestState
from .mailbox import Mailbox


class InFlight:
    """Every request the engine holds, from :meth:`open` to :meth:`close`."""

    def __init__(self) -> None:
        self.by_id: dict[RequestId, RequestRecord] = {}
        self.by_key: dict[JobKey, RequestRecord] = {}
        self.groups: dict[RequestId, set[RequestId]] = {}  # group id -> its other members in flight
        self._serial = 0  # the last JobKey given (never reused within an engine)
        self.ttft_sum = 0.0  # seconds from submission to the first events, summed
        self.ttft_count = 0

    def __len__(self) -> int:
        return len(self.by_id)

    def refuse_duplicate(self, request_id: RequestId) -> None:
        """:class:`DuplicateRequestError` if ``request_id`` is in flight."""
        if request_id in self.by_id:
            raise DuplicateRequestError(f"request id {request_id!r} is already in flight")

    def open(self, request_id: RequestId, group: RequestId | None = None) -> RequestRecord:
        """Register a new request (:class:`DuplicateRequestError` if its id is
        in flight) under a new job key, in ``group`` if one is given."""
        self.refuse_duplicate(request_id)
        self._serial += 1
        record = RequestRecord(request_id, JobKey(self._serial), Mailbox(), time.perf_counter())
        self.by_id[request_id] = record
        self.by_key[record.key] = record
        if group is not None and group != request_id:
            record.group = group
            self.groups.setdefault(group, set()).add(request_id)
        return record

    def close(self, record: RequestRecord) -> None:
        """Forget ``record`` (its request ended or its caller left)."""
        self.by_id.pop(record.request_id, None)
        self.by_key.pop(record.key, None)
        if record.group is not None:
            members = self.groups.get(record.group)
            if members is not None:
                members.discard(record.request_id)
                if not members:
                    del self.groups[record.group]

    def dispatch(self, outputs: Outputs) -> None:
        """Deliver one engine step's events to their streams' mailboxes (in
        Trio; see :mod:`.handoff`), timing each request's first events."""
        now = time.perf_counter()
        for key, (events, finished, scored) in outputs.items():
            record = self.by_key.get(key)
            if record is None:
                continue
            if scored is not None:
                record.prompt_logprobs = scored  # before the reader can see the batch
            if record.t_first is None and (not events or any(type(e) is not PromptProgress for e in events)):
                # prompt progress comes before the first token: not what time to first token measures
                record.t_first = now
                self.ttft_sum += now - record.t_submit
                self.ttft_count += 1
            record.mailbox.put(events)
            if finished:
                record.state = RequestState.FINISHED
                record.mailbox.close()  # the reader drains what is there, then sees the end

    def cancel(self, request_id: RequestId, cancel_job: Callable[[JobKey], None]) -> bool:
        """Cancel ``request_id`` and every member of the group it names; False
        if none was in flight and cancellable.  A request still preparing
        ends once its preparation returns; a submitted one through
        ``cancel_job`` (the generation thread's cancel)."""
        cancelled = self._cancel_one(request_id, cancel_job)
        for member in sorted(self.groups.get(request_id, ())):
            cancelled = self._cancel_one(member, cancel_job) or cancelled
        return cancelled

    def _cancel_one(self, request_id: RequestId, cancel_job: Callable[[JobKey], None]) -> bool:
        record = self.by_id.get(request_id)
        if record is None:
            return False
        if record.state is RequestState.PREPARING:
            record.state = RequestState.CANCELLED  # ends once preparation returns
        elif record.state is RequestState.SUBMITTED:
            record.state = RequestState.CANCELLING
            cancel_job(record.key)
        else:
            return False  # already cancelled, finished or dropped
        return True
