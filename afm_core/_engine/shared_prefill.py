"""Shared prefill: jobs with the same prompt prefill it once.

A job whose prompt (the same token ids, under the same LoRA adapter) is being
prefilled for another job still waiting or prefilling in the batch is not
prefilled again: it is *parked* on that job, its *leader* (the worker holds
it in ``by_key``, with no uid).  When the leader's prefill ends, the generator
leaves a deep copy of the leader's cache (every prompt token but the last) in
``gen.prefilled`` (see :mod:`afm_core._mlx.prefill`), and after the step
each parked job is inserted with its own copy and only its last prompt token
left to compute (``cached_tokens`` ``len(prompt) - 1``).  A leader that leaves
before its prefill ends (cancelled, dropped, failed) hands its parked jobs back
to admission (:meth:`SharedPrefill.orphan`): the first one prefills, the
others park on it.  Jobs scoring their prompt (``prompt_top_logprobs``)
neither lead nor park.

:class:`SharedPrefill` is the bookkeeping only (who leads which prompt, who is
parked on whom); the worker inserts the jobs into mlx-lm's batch.
"""

from __future__ import annotations

from collections.abc import Callable

from .commands import Job, JobKey

ShareKey = tuple[int, ...]
"""What jobs that may share a prefill are matched by: the adapter, then the prompt."""


def share_key(job: Job) -> ShareKey | None:
    """``job``'s :data:`ShareKey`, or None: a scored prompt needs its own
    prefill, a one-token prompt has nothing to share."""
    if job.prompt_top_logprobs is not None or len(job.prompt) < 2:
        return None
    return (job.adapter, *job.prompt)


class SharedPrefill:
    """The leaders prefilling a prompt others may share, and the jobs parked on them.

    ``shared`` gives the generator's set of leader uids whose prefilled cache
    must be kept for their parked jobs (``EngineBatchGenerator.shared``; a
    callable, since the worker makes its generator again after a failed step).
    """

    def __init__(self, shared: Callable[[], set[int]]):
        self._shared = shared
        self.leaders: dict[ShareKey, Job] = {}  # a prompt -> the job prefilling it
        self.leading: dict[JobKey, ShareKey] = {}  # the same, by the leader's key
        self.orphans: dict[JobKey, Job] = {}  # parked jobs whose leader left: admitted again

    @property
    def parked(self) -> int:
        """Jobs waiting now for another job's prefill."""
        return sum(len(j.followers) for j in self.leaders.values())

    def park(self, job: Job) -> bool:
        """Park ``job`` on the job prefilling its prompt, if there is one in the
        batch; True if it is parked (it waits for :meth:`followers`)."""
        key = share_key(job)
        leader = self.leaders.get(key) if key is not None else None
        if leader is None or leader.uid is None:
            return False
        job.leader = leader
        leader.followers.append(job)
        self._shared().add(leader.uid)
        return True

    def lead(self, job: Job) -> None:
        """``job`` is in the batch: later jobs with its prompt may park on it
        (unless another job already leads that prompt)."""
        key = share_key(job)
        if key is not None and key not in self.leaders:
            self.leaders[key] = job
            self.leading[job.key] = key

    def followers(self, leader: Job) -> list[Job]:
        """Take the jobs parked on ``leader``, whose prefill just ended (each
        now to be inserted with a copy of its cache)."""
        followers, leader.followers = leader.followers, []
        for job in followers:
            job.leader = None
        return followers

    def ended(self, job: Job) -> None:
        """``job``'s prefill is over (or it left): no job parks on it any more;
        any still parked become orphans, to be admitted again."""
        key = self.leading.pop(job.key, None)
        if key is not None and self.leaders.get(key) is job:
            del self.leaders[key]
        if job.followers:
            for follower in job.followers:
                follower.leader = None
                self.orphans[follower.key] = follower
            job.followers = []
        if job.uid is not None:
            self._shared().discard(job.uid)

    def leave(self, job: Job) -> None:
        """``job`` leaves the thread (finished, cancelled, failed): off its
        leader if parked, out of the orphans, and, if it leads, its parked
        jobs become orphans."""
        leader = job.leader
        if leader is not None:
            leader.followers.remove(job)
            job.leader = None
            if not leader.followers and leader.uid is not None:
                self._shared().discard(leader.uid)
        self.orphans.pop(job.key, None)
        self.ended(job)

    def orphan(self) -> Job | None:
        """The next parked job whose leader left, or None."""
        if not self.orphans:
            return None
        return self.orphans.pop(next(iter(self.orphans)))
