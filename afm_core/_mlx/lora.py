"""LoRA adapters chosen per batch row, on top of the engine's model.

mlx-lm applies one adapter to a model for good: ``load_adapters`` replaces
each targeted linear layer by a ``LoRALinear`` computing
``linear(x) + scale * ((x @ lora_a) @ lora_b)``.  The engine serves several
adapters (and the bare model) at once, in one batch, so here every targeted
layer is wrapped by :class:`AdaptedLinear`, which holds *all* the adapters'
matrices for that layer and adds, to each row of the batch, the update of
that row's own adapter:

* every row on one adapter ``k`` (or a row prefilled alone): mlx-lm's
  ``LoRALinear`` product with adapter ``k``'s ``lora_a``/``lora_b``, its last
  product, scale and sum done as one ``mx.addmm`` (equal to float rounding:
  on MLX's CPU backend a step's cost follows its operation count, and this
  takes 4 of a wrapped layer's 9 operations away);
* rows on different adapters (a decode step mixing them): the matrices are
  stacked per layer (index 0 is a zero adapter, for rows without one) and
  ``mx.gather_mm`` multiplies each row by its own adapter's, in one product
  per layer (no copy of the matrices per row);
* no row with an adapter: the base layer alone (no LoRA work at all).

Which adapter each row uses is :class:`AdapterRows`' business: it maps
mlx-lm's uids to adapter indices (``of``), and the engine's prompt and decode
batches (``afm_core._mlx.prefill``, ``afm_core._mlx.batch``) call
:meth:`AdapterRows.select_rows` with their row uids just before each forward
(the rows follow mlx-lm's own inserts and filters, since the uids are
mlx-lm's), and :meth:`AdapterRows.clear` after it.  The selection is read
when the layer is called, while the lazy graph is built, so it never leaks
into another forward.

The wrapped layer is whatever the CPU rewrite left (``afm_core._mlx.fusion``,
``qmatmul``, ``qmm_groups``): a grouped q/k/v member still gets its columns
of the family's one product (the wrapper passes its own ``x`` through), and
the update is added after it.  :func:`attach_adapters` therefore runs after
the rewrite and :func:`detach_adapters` before it is undone.

Adapter directories are mlx-lm's (``adapter_config.json`` and
``adapters.safetensors``, as ``mlx_lm.lora`` writes them); only
``fine_tune_type`` ``lora`` is served (DoRA's and full fine-tunes' weights
change the base layer itself).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

__all__ = ["AdaptedLinear", "AdapterRows", "adapter_fingerprint", "attach_adapters", "detach_adapters", "read_adapter"]


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """One adapter directory read: its scale and ``{layer path: (lora_a, lora_b)}``."""

    scale: float
    layers: dict[str, tuple[mx.array, mx.array]]


def read_adapter(path: str | Path) -> AdapterWeights:
    """Read an mlx-lm adapter directory; raises ``ValueError`` for what it cannot serve."""
    root = Path(path).expanduser()
    config_file = root / "adapter_config.json"
    weights_file = root / "adapters.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(f"{root} is not an mlx-lm adapter directory "
                         "(adapter_config.json and adapters.safetensors)")
    config = json.loads(config_file.read_text())
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise ValueError(f"{root}: fine_tune_type {kind!r} is not served (only 'lora')")
    params = config.get("lora_parameters") or {}
    scale = float(params.get("scale", 20.0))  # mlx-lm's LoRALinear default
    weights = mx.load(str(weights_file))
    assert isinstance(weights, dict)
    pairs: dict[str, dict[str, mx.array]] = {}
    for name, w in weights.items():
        layer, _, leaf = name.rpartition(".")
        if leaf not in ("lora_a", "lora_b"):
            raise ValueError(f"{root}: {name} is not a LoRA weight")
        pairs.setdefault(layer, {})[leaf] = w
    layers = {}
    for layer, ab in pairs.items():
        if set(ab) != {"lora_a", "lora_b"}:
            raise ValueError(f"{root}: {layer} lacks lora_a or lora_b")
        a, b = ab["lora_a"], ab["lora_b"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise ValueError(f"{root}: {layer} has lora_a {a.shape} and lora_b {b.shape}")
        layers[layer] = (a, b)
    if not layers:
        raise ValueError(f"{root}: no LoRA weights")
    return AdapterWeights(scale, layers)


def adapter_fingerprint(path: str | Path) -> str:
    """What an adapter *is*, for the prefix cache's disk tier: a digest of
    its ``adapter_config.json`` and ``adapters.safetensors`` bytes (not its
    name or path), so a server restarted with other weights under the same
    name never reads the caches the old ones computed."""
    root = Path(path).expanduser()
    h = hashlib.sha256()
    for name in ("adapter_config.json", "adapters.safetensors"):
        h.update(f"\n{name}\n".encode())
        with open(root / name, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:32]


class AdapterRows:
    """Which adapter each row of the next forward pass uses (see the module docstring).

    ``of`` maps an mlx-lm uid to its adapter index (1-based; rows absent
    from it use none).  ``current`` is what the wrapped layers read: None (no
    adapter), an index (every row on that one), or an array of one index per
    row (0: none); with an array, ``row_scales`` holds each row's adapter
    scale (0 for none), shaped to broadcast over a layer's output.
    ``fingerprints`` are the adapters' :func:`adapter_fingerprint` (in index
    order, from 1), which key their entries in the disk tier."""

    def __init__(self, names: Sequence[str], scales: Sequence[float] = (),
                 fingerprints: Sequence[str] = ()) -> None:
        self.names = tuple(names)
        self.fingerprints = tuple(fingerprints)
        self.scales = mx.array([0.0, *(scales or [1.0] * len(self.names))], dtype=mx.float32)
        self.of: dict[int, int] = {}
        self.current: int | mx.array | None = None
        self.row_scales: mx.array | None = None
        self.lhs: mx.array | None = None
        """With an array ``current``: the rows' own indices (``gather_mm``'s left side)."""
        self._last: tuple[tuple[int, ...], mx.array, mx.array, mx.array] | None = None

    def select_rows(self, uids: Sequence[int]) -> None:
        """Select the adapters of the batch rows ``uids`` (in row order)."""
        of = self.of
        if not of:
            self.current = None
            return
        idx = tuple(of.get(u, 0) for u in uids)
        first = idx[0] if idx else 0
        if all(i == first for i in idx):
            self.current = first or None
            return
        last = self._last
        if last is None or last[0] != idx:
            rows = mx.array(idx, dtype=mx.uint32)
            scales = self.scales[rows].reshape(-1, 1, 1)
            lhs = mx.arange(len(idx), dtype=mx.uint32)
            mx.eval(rows, scales, lhs)
            last = self._last = (idx, rows, scales, lhs)
        self.current, self.row_scales, self.lhs = last[1], last[2], last[3]

    def clear(self) -> None:
        self.current = self.row_scales = self.lhs = None


class AdaptedLinear(nn.Module):
    """A linear layer (any of the engine's kinds) plus the LoRA updates of
    every adapter that targets it, applied per row (see the module docstring)."""

    def __init__(self, linear: nn.Module, rows: AdapterRows,
                 per_adapter: list[tuple[mx.array, mx.array, float] | None]) -> None:
        super().__init__()
        self.linear = linear
        # outside the parameter tree: the engine never trains or saves them
        object.__setattr__(self, "_rows", rows)
        object.__setattr__(self, "_one", [None, *per_adapter])  # index 0: no adapter
        # (every adapter's scale is the same in every layer: AdapterRows.row_scales holds it per row)
        rank = max(a.shape[1] for a, _, _ in (p for p in per_adapter if p is not None))
        in_dims, out_dims = next((a.shape[0], b.shape[1]) for a, b, _ in
                                 (p for p in per_adapter if p is not None))
        dtype = next(a.dtype for a, _, _ in (p for p in per_adapter if p is not None))
        a_stack = [mx.zeros((in_dims, rank), dtype=dtype)]
        b_stack = [mx.zeros((rank, out_dims), dtype=dtype)]
        for p in per_adapter:
            if p is None:
                a_stack.append(a_stack[0])
                b_stack.append(b_stack[0])
                continue
            a, b, _ = p
            pad = rank - a.shape[1]
            if pad:  # zero columns and rows add exact zeros
                a = mx.concatenate([a, mx.zeros((in_dims, pad), dtype=a.dtype)], axis=1)
                b = mx.concatenate([b, mx.zeros((pad, out_dims), dtype=b.dtype)], axis=0)
            a_stack.append(a.astype(dtype))
            b_stack.append(b.astype(dtype))
        stacks = (mx.stack(a_stack), mx.stack(b_stack))
        mx.eval(stacks)
        object.__setattr__(self, "_stacks", stacks)

    @property
    def adapter_bytes(self) -> int:
        a, b = self._stacks
        return int(a.nbytes + b.nbytes) + sum(
            p[0].nbytes + p[1].nbytes for p in self._one if p is not None)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        sel = self._rows.current
        if sel is None:
            return y
        if isinstance(sel, int):
            one = self._one[sel]
            if one is None:
                return y
            a, b, scale = one
            if y.dtype == x.dtype == a.dtype == b.dtype:
                # mlx-lm's y + scale * ((x @ a) @ b), the last product, scale and sum as one
                # operation (the same to float rounding; 4 operations per layer fewer)
                return mx.addmm(y, x @ a, b, alpha=scale)
            z = scale * ((x @ a) @ b)  # mlx-lm's LoRALinear, as is
            return y + z.astype(x.dtype)
        a_stack, b_stack = self._stacks
        rows = self._rows
        z = rows.row_scales * mx.gather_mm(mx.gather_mm(x, a_stack, lhs_indices=rows.lhs, rhs_indices=sel),
                                           b_stack, lhs_indices=rows.lhs, rhs_indices=sel)
        return y + (z if z.dtype == x.dtype else z.astype(x.dtype))


def _dims(layer: Any) -> tuple[int, int] | None:
    """(input, output) dims of a linear layer of any of the engine's kinds, or None."""
    from .fusion import _TransposedLinear

    if not isinstance(layer, nn.Module) or "weight" not in layer or layer["weight"].ndim != 2:
        return None
    out_dims, in_dims = layer["weight"].shape
    if isinstance(layer, nn.QuantizedLinear):
        from .qmatmul import input_dims

        in_dims = input_dims(layer)
    elif isinstance(layer, _TransposedLinear):
        in_dims, out_dims = out_dims, in_dims
    elif not isinstance(layer, nn.Linear):
        return None
    return in_dims, out_dims


def attach_adapters(model: nn.Module, adapters: Sequence[tuple[str, str | Path]]) -> AdapterRows:
    """Wrap every layer that one of ``adapters`` ((name, directory) pairs;
    adapter ``i`` gets index ``i + 1``) targets; raises ``ValueError`` when an
    adapter does not fit the model.  Returns the rows' selector."""
    read = [(name, read_adapter(path)) for name, path in adapters]
    modules = dict(model.named_modules())
    targets = sorted({layer for _, w in read for layer in w.layers})
    rows = AdapterRows([name for name, _ in read], [w.scale for _, w in read],
                       [adapter_fingerprint(path) for _, path in adapters])
    for path in targets:
        layer = modules.get(path)
        dims = _dims(layer)
        if layer is None or dims is None:
            raise ValueError(f"adapter layer {path} is not a linear layer of this model")
        per: list[tuple[mx.array, mx.array, float] | None] = []
        for name, w in read:
            ab = w.layers.get(path)
            if ab is None:
                per.append(None)
                continue
            a, b = ab
            if (a.shape[0], b.shape[1]) != dims:
                raise ValueError(f"adapter {name!r}: {path} is {a.shape[0]} -> {b.shape[1]}, "
                                 f"the model's layer {dims[0]} -> {dims[1]}")
            per.append((a, b, w.scale))
        parent_path, _, attr = path.rpartition(".")
        parent = modules[parent_path] if parent_path else model
        setattr(parent, attr, AdaptedLinear(layer, rows, per))
    return rows


def detach_adapters(model: nn.Module) -> int:
    """Put the wrapped layers back (before the CPU rewrite is undone); returns how many."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, AdaptedLinear)]
    modules = dict(model.named_modules())
    for name, wrapped in found:
        parent_path, _, attr = name.rpartition(".")
        setattr(modules[parent_path] if parent_path else model, attr, wrapped.linear)
    return len(found)


def adapter_bytes(model: nn.Module) -> int:
    """Bytes the attached adapters' matrices take."""
    return sum(m.adapter_bytes for _, m in model.named_modules() if isinstance(m, AdaptedLinear))
