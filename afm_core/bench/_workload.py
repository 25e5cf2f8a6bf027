"""Seeded workloads: the same prompts and lengths for every target in a run.

A ``Workload`` is a list of ``Job`` (chat messages plus ``max_tokens``),
built from a seed by ``make_workload``; ``poisson_schedule`` gives open-loop
arrival offsets.  Both are deterministic for a given seed and use their own
``random.Random`` so nothing else in the process can disturb them.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

# A small fixed vocabulary: prompts differ in words and length, never in
# anything that depends on the installed Python or on files on disk.
_WORDS: tuple[str, ...] = tuple(
    """
    the a of to and in that is for it as with was on be by this are at from
    model token stream server client latency batch request engine memory cache
    apple silicon metal kernel thread queue event chunk delta usage profile
    local inference fast slow small large first next last every each some many
    write read send receive open close start stop wait run measure compare
    river mountain garden window letter number colour music paper candle
    quiet bright simple careful honest gentle steady sudden ancient modern
    """.split()
)

_TASKS: tuple[str, ...] = (
    "Summarize the following notes.",
    "Continue this text.",
    "Rewrite this in plain words.",
    "List the key points of this passage.",
    "Explain what this means.",
)


@dataclass(frozen=True, slots=True)
class Job:
    """One request: chat messages and the completion budget."""

    index: int
    messages: tuple[dict[str, str], ...]
    max_tokens: int
    # the completions API's prompt text when it is not the messages' text: a
    # run over several APIs renders the chat template into it (``templated``)
    prompt: str | None = None

    def body(self, *, model: str | None, stream: bool = True) -> dict[str, Any]:
        """The OpenAI chat-completions request body for this job."""
        body: dict[str, Any] = {
            "messages": [dict(m) for m in self.messages],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if model is not None:
            body["model"] = model
        return body


@dataclass(frozen=True, slots=True)
class Workload:
    """The seeded job list; ``job(i)`` cycles so any request count works."""

    seed: int
    jobs: tuple[Job, ...]

    def job(self, i: int) -> Job:
        return self.jobs[i % len(self.jobs)]

    def describe(self) -> dict[str, Any]:
        words = [len(j.messages[-1]["content"].split()) for j in self.jobs]
        return {
            "seed": self.seed,
            "distinct_prompts": len(self.jobs),
            "prompt_words_min": min(words),
            "prompt_words_max": max(words),
            "max_tokens": sorted({j.max_tokens for j in self.jobs}),
        }


def templated(workload: Workload, render: Any) -> Workload:
    """``workload`` with every job's ``prompt`` set to ``render(messages)``
    (the chat template as text, generation prompt included), so the
    completions API sends the very tokens the chat APIs' template gives."""
    return Workload(workload.seed, tuple(
        dataclasses.replace(j, prompt=render([dict(m) for m in j.messages]))
        for j in workload.jobs))


def make_prompt(rng: random.Random, n_words: int) -> str:
    """A task line followed by ``n_words`` words drawn from the vocabulary."""
    task = rng.choice(_TASKS)
    words = [rng.choice(_WORDS) for _ in range(n_words)]
    return f"{task} {' '.join(words)}"


def make_workload(
    seed: int,
    n_jobs: int,
    *,
    prompt_words: tuple[int, int] = (16, 64),
    max_tokens: int | tuple[int, int] = 64,
) -> Workload:
    """``n_jobs`` seeded jobs with prompt word counts and ``max_tokens`` in
    the given inclusive ranges (a single int means a fixed length)."""
    if n_jobs < 1:
        raise ValueError("n_jobs must be >= 1")
    lo, hi = prompt_words
    if not 1 <= lo <= hi:
        raise ValueError(f"bad prompt_words range {prompt_words}")
    mlo, mhi = (max_tokens, max_tokens) if isinstance(max_tokens, int) else max_tokens
    if not 1 <= mlo <= mhi:
        raise ValueError(f"bad max_tokens range {max_tokens}")
    rng = random.Random(seed)
    jobs = []
    for i in range(n_jobs):
        text = make_prompt(rng, rng.randint(lo, hi))
        jobs.append(
            Job(index=i, messages=({"role": "user", "content": text},),
                max_tokens=rng.randint(mlo, mhi))
        )
    return Workload(seed=seed, jobs=tuple(jobs))


def poisson_schedule(rate: float, n: int, seed: int) -> list[float]:
    """Arrival offsets in seconds (sorted, first > 0) for ``n`` requests of a
    Poisson process with ``rate`` requests per second."""
    if rate <= 0.0:
        raise ValueError("rate must be > 0")
    if n < 0:
        raise ValueError("n must be >= 0")
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out
