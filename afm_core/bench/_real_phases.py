"""The phases of one model's ``--real-model`` run and their prompts.

* ``decode``: one request at a time, short prompts, ``decode_tokens`` tokens;
* ``batch``: ``batch_concurrency`` (8) streams at once, short prompts;
* ``ttft_512``, ``ttft_4k``, ``ttft_16k`` (``ttft_lengths``): one request at
  a time, a long prompt of that many tokens (``_prompts``: an agent system
  prompt with tools and source files), a few output tokens.  A length beyond
  the model's context is capped to it (the phase keeps its name, its title
  says the cap); two lengths capped to the same one run once.

Prompt lengths are counted with the model's tokenizer (:func:`make_counter`:
afm's converted directory's, else llama.cpp's ``/apply-template`` and
``/tokenize``, else an estimate of 3.5 characters a token, said in the report).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from . import _prompts
from ._apis import prompt_text
from ._real_models import ModelSpec
from ._workload import Job, Workload, make_workload

__all__ = ["Phase", "PhasePlan", "length_label", "make_counter", "make_long_phase", "plan_phases",
           "short_phases"]


@dataclass(frozen=True, slots=True)
class PhasePlan:
    """A phase before its prompts exist."""

    name: str
    kind: str  # decode, batch, ttft
    concurrency: int
    requests: int
    max_tokens: int
    prompt_tokens: int | None = None  # ttft: the (capped) target length
    requested_tokens: int | None = None  # ttft: the length asked for
    warm: bool = True


@dataclass(slots=True)
class Phase:
    """A phase with its workload; round ``r`` uses jobs ``r*requests ..``,
    the warm-up the jobs after the last round's."""

    plan: PhasePlan
    workload: Workload
    title: str
    prompt_tokens: list[int] = field(default_factory=list)  # counted, by job
    digests: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.plan.name

    def first_index(self, round_: int) -> int:
        return round_ * self.plan.requests

    def describe(self) -> dict[str, Any]:
        p = self.plan
        counted = self.prompt_tokens
        return {"name": p.name, "kind": p.kind, "title": self.title, "concurrency": p.concurrency,
                "requests_per_round": p.requests, "max_tokens": p.max_tokens,
                "prompt_tokens_target": p.prompt_tokens, "prompt_tokens_requested": p.requested_tokens,
                "prompt_tokens_mean": sum(counted) / len(counted) if counted else None,
                "prompt_tokens_by_job": counted or None, "prompt_digests": self.digests or None,
                "warmed_up": p.warm}


def length_label(n: int) -> str:
    """512 -> "512", 4096 -> "4k", 16384 -> "16k", 1500 -> "1500"."""
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def plan_phases(cfg: Any, context: int | None) -> list[PhasePlan]:
    """The model's phases for a ``RealConfig`` (``context``: the model's, or None)."""
    plans = [
        PhasePlan("decode", "decode", 1, cfg.decode_requests, cfg.decode_tokens),
        PhasePlan("batch", "batch", cfg.batch_concurrency, cfg.batch_requests, cfg.batch_tokens),
    ]
    cap = None if context is None else max(64, context - cfg.ttft_max_tokens - 16)
    seen: set[int] = set()
    shortest = min(cfg.ttft_lengths) if cfg.ttft_lengths else 0
    for n in cfg.ttft_lengths:
        length = n if cap is None else min(n, cap)
        if length in seen:
            continue
        seen.add(length)
        plans.append(PhasePlan(f"ttft_{length_label(n)}", "ttft", 1, cfg.ttft_requests,
                               cfg.ttft_max_tokens, prompt_tokens=length, requested_tokens=n,
                               warm=n == shortest and length <= 1024))
    return plans


def short_phases(cfg: Any, plans: list[PhasePlan]) -> list[Phase]:
    """The decode and batch phases (seeded word prompts)."""
    out = []
    for k, p in enumerate(plans):
        if p.kind == "ttft":
            continue
        n_jobs = p.requests * cfg.rounds + cfg.warmup
        wl = make_workload(cfg.seed * 4 + k + 1, n_jobs, prompt_words=cfg.short_prompt_words,
                           max_tokens=p.max_tokens)
        if p.kind == "decode":
            title = f"1 stream, {p.max_tokens} tokens, short prompts ({p.requests} per round)"
        else:
            title = (f"{p.concurrency} streams at once, {p.max_tokens} tokens each, short prompts "
                     f"({p.requests} per round)")
        out.append(Phase(p, wl, title))
    return out


Counter = _prompts.Counter


def make_counter(spec: ModelSpec, llama_url: str | None) -> tuple[Counter | None, str]:
    """How prompt lengths are counted for ``spec`` (a counter and its source)."""
    chat = spec.chat
    if spec.directory is not None:
        from mlx_lm.utils import load_tokenizer

        tok = load_tokenizer(Path(spec.directory))

        async def count_hf(messages: _prompts.Messages) -> int:
            if chat:
                return len(tok.apply_chat_template(messages, add_generation_prompt=True,
                                                   tokenize=True))
            return len(tok.encode(_joined(messages)))

        return count_hf, "afm's tokenizer"
    if llama_url is not None:
        async def count_llama(messages: _prompts.Messages) -> int:
            async with httpx.AsyncClient(base_url=llama_url, timeout=60.0, trust_env=False) as c:
                text = _joined(messages)
                if chat:
                    resp = await c.post("/apply-template", json={"messages": messages})
                    text = resp.json()["prompt"]
                resp = await c.post("/tokenize", json={"content": text, "add_special": True,
                                                       "parse_special": True})
                return len(resp.json()["tokens"])

        return count_llama, "llama.cpp's tokenizer"
    return None, "estimated (3.5 characters a token: no tokenizer)"


def _joined(messages: _prompts.Messages) -> str:
    return prompt_text(Job(0, tuple(messages), 1))


async def _estimate(messages: _prompts.Messages) -> int:
    return round(len(_joined(messages)) / 3.5)


async def make_long_phase(cfg: Any, plan: PhasePlan, count: Counter | None) -> Phase:
    """A TTFT phase: every job's prompt fitted to the plan's length."""
    assert plan.prompt_tokens is not None
    n_jobs = plan.requests * cfg.rounds + (cfg.warmup if plan.warm else 0)
    jobs, lengths, digests = [], [], []
    seed = cfg.seed * 1000 + plan.prompt_tokens
    for i in range(n_jobs):
        msgs, n = await _prompts.calibrated_messages(count or _estimate, i, plan.prompt_tokens,
                                                     seed=seed)
        jobs.append(Job(index=i, messages=tuple(msgs), max_tokens=plan.max_tokens))
        lengths.append(n)
        digests.append(_prompts.digest(msgs))
    asked = plan.requested_tokens or plan.prompt_tokens
    cap = "" if asked == plan.prompt_tokens else \
        f" (asked {asked}: capped to the model's context)"
    title = (f"1 stream, ~{plan.prompt_tokens}-token prompts{cap}, {plan.max_tokens} tokens "
             f"({plan.requests} per round{'' if plan.warm else ', not warmed up'})")
    return Phase(plan, Workload(seed, tuple(jobs)), title, lengths, digests)
