"""``X-AFM-Profile``'s summary sends exactly the fields :data:`FIELDS` declares, in its order."""

from __future__ import annotations

from afm_core._engine.profile import FIELDS, ProfileRecorder


def _payload(recorder: ProfileRecorder, **kw: object) -> dict:
    args = {"prompt_tokens": 10, "cached_tokens": 4, "completion_tokens": 3, "weights_bytes": 1 << 20,
            "kv_bytes": 1 << 10, "active_bytes": 1 << 21, "peak_bytes": 1 << 22, "device": "cpu"}
    return recorder.payload(**{**args, **kw})  # type: ignore[arg-type]


def test_every_field_sent_is_declared_and_in_order() -> None:
    rec = ProfileRecorder(extended=False, t_submit=0.0)
    rec.admitted(0.5)
    for i, t in enumerate((1.0, 1.5, 2.0)):
        rec.step(t, i + 1, batch_size=2, active_bytes=1 << 21)
    rec.prefix_tier, rec.spec = "memory", (6, 4)
    full = _payload(rec, blas="openblas", kv_bits=8)
    assert list(full) == [n for n in FIELDS if n in full]
    # everything but the Apple-only figure, on this machine
    assert set(FIELDS) - set(full) <= {"theoretical_bw_gbs"}
    assert (full["prefix_tier"], full["spec_proposed"], full["spec_accepted"]) == ("memory", 6, 4)
    assert full["decode_tok_s"] == 2.0 and full["batch_size_mean"] == 2.0


def test_a_bare_request_sends_a_subset() -> None:
    rec = ProfileRecorder(extended=True, t_submit=0.0)
    out = _payload(rec, cached_tokens=0, completion_tokens=0)
    summary = out["summary"]
    assert set(summary) <= set(FIELDS) and summary["prefix_tier"] is None
    assert "spec_proposed" not in summary and "blas" not in summary and out["samples"] == []
    for unit, source in FIELDS.values():
        assert unit and source
