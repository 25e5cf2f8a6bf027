"""Issue 30, item 3: instructor 1.17.0, unmodified, in its JSON, JSON_SCHEMA and
TOOLS modes against a real server on the random model.

JSON mode sends ``response_format: {"type": "json_object"}`` (the schema in
the prompt), JSON_SCHEMA mode a ``json_schema`` without ``strict``, TOOLS
mode a named ``tool_choice``.  The random model's own output is never JSON:
the grammar makes each mode's answer parse and validate; with
``--no-enforce-json-modes`` JSON_SCHEMA mode fails as it did before.
instructor's pins (jiter<0.15, rich<15) conflict with the ``openai`` this
project tests against, so ``make install`` puts it in with ``--no-deps``
(its code runs on both); skipped where it is absent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict

from afm_http.testing import running_server

instructor = pytest.importorskip("instructor", reason="instructor is not installed (make install puts it in: "
                                  "pip install --no-deps instructor==1.17.0)")

CLIENT_VERSION = "1.17.0"


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Oslo"]
    sunny: bool


class Anything(BaseModel):
    """JSON mode's prompt carries the schema, the grammar only an object: any object validates."""

    model_config = ConfigDict(extra="allow")


def client(url: str, mode: Any) -> Any:
    raw = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    return instructor.from_openai(raw, mode=mode)


async def ask(c: Any, model: type[BaseModel], **kw: Any) -> Any:
    return await c.chat.completions.create(
        model="m", response_model=model, max_retries=0, temperature=1.0, seed=1,
        messages=[{"role": "user", "content": "Which city? Answer as JSON."}], **kw)


async def test_instructor_modes_on_the_random_model(random_model_dir: Path) -> None:
    assert instructor.__version__ == CLIENT_VERSION
    async with running_server(random_model_dir, warmup=False) as (url, engine):
        rbrace = engine._tokenizer.encode("}", add_special_tokens=False)[0]
        city = await ask(client(url, instructor.Mode.JSON_SCHEMA), City, max_tokens=40,
                         extra_body={"enable_thinking": False})
        assert isinstance(city, City) and city.city in ("Paris", "Oslo")
        # the bias closes the object the random model would otherwise keep writing
        obj = await ask(client(url, instructor.Mode.JSON), Anything, max_tokens=200,
                        logit_bias={str(rbrace): 6}, extra_body={"enable_thinking": False})
        assert isinstance(obj, Anything)
        tool = await ask(client(url, instructor.Mode.TOOLS), City, max_tokens=60,
                         extra_body={"enable_thinking": False})
        assert isinstance(tool, City) and tool.city in ("Paris", "Oslo")
    async with running_server(random_model_dir, warmup=False, enforce_json_modes=False) as (url, _):
        from instructor.core.exceptions import InstructorError

        with pytest.raises(InstructorError):
            await ask(client(url, instructor.Mode.JSON_SCHEMA), City, max_tokens=40,
                      extra_body={"enable_thinking": False})
