"""A model's sampling defaults (an Ollama ``params`` layer) fill only the fields a request leaves out."""

from __future__ import annotations

from afm_core.api.defaults import API_FIELDS, model_defaults, with_model_defaults


def test_model_defaults_keeps_known_options_in_range() -> None:
    params = {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "repeat_penalty": 1.1,
              "stop": ["<|im_start|>", "<|im_end|>", "", 3], "num_predict": 128, "seed": 7,
              "num_ctx": 8192, "mirostat": 2, "presence_penalty": 0.5, "frequency_penalty": -0.5}
    assert model_defaults(params) == {
        "temperature": 0.7, "top_p": 0.9, "min_p": 0.05, "repeat_penalty": 1.1, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "top_k": 40, "seed": 7, "num_predict": 128,
        "stop": ["<|im_start|>", "<|im_end|>"]}
    bad = {"temperature": 9, "top_p": "0.9", "top_k": True, "seed": -1, "num_predict": -1,
           "repeat_penalty": float("nan"), "stop": 5}
    assert model_defaults(bad) == {}
    assert model_defaults({"stop": "END"}) == {"stop": ["END"]}
    assert model_defaults({"stop": [f"s{i}" for i in range(9)]})["stop"] == ["s0", "s1", "s2", "s3"]


def test_a_request_value_always_wins() -> None:
    d = model_defaults({"temperature": 0.2, "top_k": 20, "stop": ["x"], "num_predict": 9})
    body = {"messages": [], "temperature": 1.0, "stop": None}
    out = with_model_defaults("chat", body, d)
    assert out == {"messages": [], "temperature": 1.0, "stop": ["x"], "top_k": 20, "max_tokens": 9}
    assert body == {"messages": [], "temperature": 1.0, "stop": None}  # not changed in place
    # max_completion_tokens is chat's other name for max_tokens
    assert "max_tokens" not in with_model_defaults("chat", {"max_completion_tokens": 3}, d)
    assert with_model_defaults("responses", {"input": "x"}, d) == {
        "input": "x", "temperature": 0.2, "max_output_tokens": 9}
    assert with_model_defaults("anthropic", {"max_tokens": 5}, d) == {
        "max_tokens": 5, "temperature": 0.2, "top_k": 20, "stop_sequences": ["x"]}
    assert with_model_defaults("anthropic", {}, {"temperature": 1.5})["temperature"] == 1.0
    out = with_model_defaults("ollama", {"model": "m", "options": {"top_k": 1}}, d)
    assert out["options"] == {"top_k": 1, "temperature": 0.2, "stop": ["x"], "num_predict": 9}


def test_nothing_to_add_returns_the_body_itself() -> None:
    d = model_defaults({"temperature": 0.2})
    for kind in API_FIELDS:
        body: object = {"temperature": 0.5, "options": {"temperature": 0.5}}
        assert with_model_defaults(kind, body, d) is body
        assert with_model_defaults(kind, body, {}) is body
    assert with_model_defaults("chat", [1, 2], d) == [1, 2]  # the API's own error follows
    assert with_model_defaults("ollama", {"options": "x"}, d) == {"options": "x"}
