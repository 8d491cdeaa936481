"""Which layers does quantization hurt? Per-linear output error and per-module KL gain, then a recipe.

Both engines see the same tokens. `relative_errors`: forward hooks on the reference capture each
linear's input; the candidate's module runs on that same input, so the error is the module's own,
not inherited from earlier layers (‖y_cand − y_ref‖ / ‖y_ref‖, per projection). `kl_gains`: swap one
candidate module (q/k/v, o_proj, gate/up, down_proj, or the embedding/lm_head) into the reference
model and measure the mean KL(reference ‖ patched) — the KL gained when only that module is quantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn

from edgellm.errors import EdgeLLMError
from edgellm.eval.metrics import kl_per_position
from edgellm.families.registry import family_of

if TYPE_CHECKING:
    from edgellm.models.transformer import Transformer
    from edgellm.runtime.engine import Engine

_PER_WEIGHT_BYTES = {"f32": 4.0, "f16": 2.0, "q8": 1.0, "q4": 0.625}  # q4: 4 bits + f16 scale/min per 32


@dataclass(frozen=True)
class Slot:
    """One replaceable module of the model and the HF weight prefixes it computes."""

    name: str
    path: tuple[str, ...]  # attribute path from the Transformer; ("embed", "lm_head") for tied tables
    prefixes: tuple[str, ...]


def slots(model: Transformer) -> list[Slot]:
    """The quantized modules of a Transformer, in execution order."""
    cfg = model.config
    family = family_of(cfg.architecture)
    out = []
    tied = cfg.tie_word_embeddings
    out.append(Slot("embed_tokens" + (" + lm_head (tied)" if tied else ""), ("embed", "lm_head") if tied
                    else ("embed",), ("model.embed_tokens",)))
    for i in range(len(model.layers)):
        out += [Slot(path, (path,), tuple(weights)) for path, weights in family.layer_modules(cfg, i).items()]
    if not tied:
        out.append(Slot("lm_head", ("lm_head",), ("lm_head",)))
    return out


def _swap(model: nn.Module, path: str, module: nn.Module) -> nn.Module:
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = getattr(parent, attr)
    setattr(parent, attr, module)
    return old


_Output = torch.Tensor | list[torch.Tensor] | tuple[torch.Tensor, ...]  # a module's: FusedLinear gives a list


def _outputs(y: _Output) -> list[torch.Tensor]:
    return list(y) if isinstance(y, (list, tuple)) else [y]


def relative_errors(ref_model: Transformer, cand_model: Transformer, run: Callable[[], Any]) -> dict[str, float]:
    """‖Δy‖/‖y‖ per HF weight prefix, with the candidate module fed the reference's input."""
    sums: dict[str, list[float]] = {}
    handles = []
    for slot in slots(ref_model):
        path = "lm_head" if len(slot.path) == 2 else slot.path[0]  # tied table: measured as the output layer
        cand = cand_model.get_submodule(path)

        def hook(_m: nn.Module, inputs: tuple[torch.Tensor, ...], output: _Output, cand: nn.Module = cand,
                 names: tuple[str, ...] = slot.prefixes) -> None:
            for name, r, c in zip(names, _outputs(output), _outputs(cand(inputs[0]))):
                acc = sums.setdefault(name, [0.0, 0.0])
                acc[0] += (c.float() - r.float()).pow(2).sum().item()
                acc[1] += r.float().pow(2).sum().item()

        handles.append(ref_model.get_submodule(path).register_forward_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return {k: (num / den) ** 0.5 if den else 0.0 for k, (num, den) in sums.items()}


def kl_gains(ref_model: Transformer, cand_model: Transformer, logits: Callable[[], torch.Tensor],
             only: list[Slot] | None = None,
             progress: Callable[[str], None] | None = None) -> Iterator[tuple[Slot, float]]:
    """(slot, mean KL(ref ‖ ref with only that slot quantized)) for every slot (or those in `only`)."""
    base = logits()
    for slot in only if only is not None else slots(ref_model):
        olds = [_swap(ref_model, p, cand_model.get_submodule(p)) for p in slot.path]
        try:
            patched = logits()
        finally:
            for p, old in zip(slot.path, olds):
                _swap(ref_model, p, old)
        if progress:
            progress(f"KL gain of {slot.name}")
        yield slot, kl_per_position(base, patched).mean().item()


def slot_weights(model: nn.Module, slot: Slot) -> int:
    """Number of weights in the slot's matrices."""
    total = 0
    for path in slot.path[:1]:
        m = model.get_submodule(path)
        linears = getattr(m, "linears", [m])
        for lin in linears:
            shape = (lin.out_features, lin.in_features) if hasattr(lin, "out_features") else (
                lin.num_embeddings, lin.embedding_dim)
            total += shape[0] * shape[1]
    return total


def upgrade_bytes(n_weights: int, frm: str, to: str = "q8") -> float:
    """Approximate extra bytes on disk when n weights move from format `frm` to `to`."""
    return n_weights * (_PER_WEIGHT_BYTES[to] - _PER_WEIGHT_BYTES[frm])



def _torch_modules(engine: Engine) -> Transformer:
    """The torch Transformer an engine runs (alone, or as the torch half of the mixed path), whose modules
    attribution swaps; a one-line error for an engine without one."""
    from edgellm.models.torch_native import TorchPrefillNativeDecode
    from edgellm.models.transformer import Transformer

    model = engine.model
    if isinstance(model, TorchPrefillNativeDecode):
        return model.torch
    if isinstance(model, Transformer):
        return model
    raise EdgeLLMError("per-layer attribution swaps torch modules: open both engines with runtime='torch'")


def attribute(ref_engine: Engine, cand_engine: Engine, windows: list[list[int]], *, kl_top: int | None = None,
              progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One row per slot: candidate format, relative output error per weight, KL gain, size of a q8 upgrade.

    The KL gain costs one forward pass per slot, so with `kl_top` it is measured only for the `kl_top`
    slots of largest relative error (the others get None)."""
    ref, cand = _torch_modules(ref_engine), _torch_modules(cand_engine)
    formats = cand_engine.config.quantization.formats

    def run() -> torch.Tensor:
        return torch.cat([ref_engine.logits(w) for w in windows]).float()

    errors = relative_errors(ref, cand, run)
    all_slots = slots(ref)
    only = None
    if kl_top is not None:
        only = sorted(all_slots, key=lambda s: max(errors.get(p, 0.0) for p in s.prefixes), reverse=True)[:kl_top]
    gains = {s.name: g for s, g in kl_gains(ref, cand, run, only, progress)}
    rows = []
    for slot in all_slots:
        fmt = formats[slot.prefixes[0]]
        n = slot_weights(cand, slot)
        rows.append({
            "slot": slot.name, "prefixes": list(slot.prefixes), "format": fmt, "weights": n,
            "rel_error": max(errors.get(p, 0.0) for p in slot.prefixes),
            "rel_error_per_weight": {p: errors.get(p, 0.0) for p in slot.prefixes},
            "kl_gain": gains.get(slot.name),
            "q8_extra_bytes": max(0.0, upgrade_bytes(n, fmt)) if fmt in _PER_WEIGHT_BYTES else 0.0,
        })
    return rows


def recipe_from(rows: list[dict[str, Any]], base: str, keep: int, by: str = "kl_gain") -> dict[str, Any]:
    """Keep the `keep` most sensitive slots (by KL gain, or by relative error) at 8 bits."""
    def key(r: dict[str, Any]) -> tuple[float, float]:
        gain = -1.0 if r["kl_gain"] is None else r["kl_gain"]  # unmeasured slots rank after measured ones
        return (gain, r["rel_error"]) if by == "kl_gain" else (r["rel_error"], gain)

    picked = [r for r in sorted(rows, key=key, reverse=True) if r["format"] == "q4"][:keep]
    overrides = {p: "q8" for r in picked for p in r["prefixes"]}
    extra = sum(r["q8_extra_bytes"] for r in picked)
    return {"base": base, "overrides": overrides, "selected": [r["slot"] for r in picked],
            "note": f"{len(picked)} most sensitive modules by {by} kept at q8; about "
                    f"{extra / 2**20:.1f} MiB more than {base}"}
