"""A numpy (float64) forward pass over a GGUF file's tensors, as llama.cpp
computes each architecture: the converter's oracle.

It reads the tensors under their GGUF names and with GGUF's conventions (the
Q/K rows of llama permuted for llama.cpp's interleaved RoPE, Gemma's norms
stored as ``1 + w``, Phi-3's fused projections), so it shares nothing with
the converter's own renaming and re-ordering.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Tensors = dict[str, np.ndarray]


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def rope(x: np.ndarray, pos: np.ndarray, base: float, dims: int, *, neox: bool,
         scale: float = 1.0) -> np.ndarray:
    """Rotary embedding of the first ``dims`` features of ``x`` (tokens, heads, head_dim):
    NEOX pairs (i, i + dims/2), llama.cpp's "normal" pairs (2i, 2i + 1)."""
    half = dims // 2
    theta = (pos[:, None] * scale) * base ** (-np.arange(half) * 2.0 / dims)  # (tokens, half)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., :half], x[..., half:dims]
        out[..., :half], out[..., half:dims] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., 0:dims:2], x[..., 1:dims:2]
        out[..., 0:dims:2], out[..., 1:dims:2] = a * cos - b * sin, a * sin + b * cos
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, *,
              window: int | None = None, softcap: float | None = None) -> np.ndarray:
    """Causal attention with grouped KV heads: q (T, H, D), k/v (T, KV, D)."""
    t, heads, _ = q.shape
    rep = heads // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= (i - j) < window
    scores = np.where(allowed[None], scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


def _lin(x: np.ndarray, w: Tensors, name: str) -> np.ndarray:
    y = x @ w[f"{name}.weight"].T
    bias = w.get(f"{name}.bias")
    return y if bias is None else y + bias


def _moe(x: np.ndarray, w: Tensors, p: str, used: int) -> np.ndarray:
    logits = x @ w[f"{p}.ffn_gate_inp.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        top = np.argsort(-probs[t])[:used]
        weights = probs[t, top] / probs[t, top].sum()
        for e, g in zip(top, weights, strict=True):
            gate = w[f"{p}.ffn_gate_exps.weight"][e] @ x[t]
            up = w[f"{p}.ffn_up_exps.weight"][e] @ x[t]
            out[t] += g * (w[f"{p}.ffn_down_exps.weight"][e] @ (silu(gate) * up))
    return out


def forward(arch: str, hp: dict[str, Any], w: Tensors, ids: list[int]) -> np.ndarray:
    """Logits (tokens, vocab) of the GGUF model ``arch`` with hyperparameters ``hp``."""
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    heads, kv, hd = hp["heads"], hp["kv_heads"], hp["head_dim"]
    eps, base = hp["eps"], hp["rope_base"]
    gemma = arch in ("gemma2", "gemma3")
    pos = np.arange(len(ids), dtype=np.float64)
    x = w["token_embd.weight"][ids]
    if gemma:
        x = x * np.sqrt(hp["hidden"])
    for layer in range(hp["layers"]):
        p = f"blk.{layer}"
        h = rms_norm(x, w[f"{p}.attn_norm.weight"], eps)
        if arch == "phi3":
            qkv = _lin(h, w, f"{p}.attn_qkv")
            q, k, v = np.split(qkv, [heads * hd, (heads + kv) * hd], axis=-1)
        else:
            q, k, v = (_lin(h, w, f"{p}.attn_{n}") for n in "qkv")
        q, k, v = q.reshape(-1, heads, hd), k.reshape(-1, kv, hd), v.reshape(-1, kv, hd)
        if f"{p}.attn_q_norm.weight" in w:
            q = rms_norm(q, w[f"{p}.attn_q_norm.weight"], eps)
            k = rms_norm(k, w[f"{p}.attn_k_norm.weight"], eps)
        window, layer_base, scale = None, base, 1.0
        if arch == "gemma3":
            if (layer + 1) % 6:
                window, layer_base = hp["window"], 10000.0
            else:
                scale = 1.0 / hp.get("rope_linear", 1.0)
        elif hp.get("window"):
            window = hp["window"]
        neox = arch != "llama"
        dims = hp.get("rope_dims", hd)
        q = rope(q, pos, layer_base, dims, neox=neox, scale=scale)
        k = rope(k, pos, layer_base, dims, neox=neox, scale=scale)
        att = attention(q, k, v, hp.get("query_scale", hd**-0.5), window=window,
                        softcap=hp.get("attn_softcap"))
        o = _lin(att.reshape(len(ids), -1), w, f"{p}.attn_output")
        if gemma:
            o = rms_norm(o, w[f"{p}.post_attention_norm.weight"], eps)
        x = x + o
        h = rms_norm(x, w[f"{p}.ffn_norm.weight"], eps)
        if arch == "qwen3moe":
            f = _moe(h, w, p, hp["experts_used"])
        elif arch == "phi3":
            gate, up = np.split(_lin(h, w, f"{p}.ffn_up"), 2, axis=-1)
            f = _lin(silu(gate) * up, w, f"{p}.ffn_down")
        else:
            act = gelu_tanh if gemma else silu
            f = _lin(act(_lin(h, w, f"{p}.ffn_gate")) * _lin(h, w, f"{p}.ffn_up"), w, f"{p}.ffn_down")
        if gemma:
            f = rms_norm(f, w[f"{p}.post_ffw_norm.weight"], eps)
        x = x + f
    x = rms_norm(x, w["output_norm.weight"], eps)
    logits = x @ w.get("output.weight", w["token_embd.weight"]).T
    if hp.get("final_softcap"):
        logits = hp["final_softcap"] * np.tanh(logits / hp["final_softcap"])
    return logits
