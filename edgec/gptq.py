"""GPTQ: 4-bit rounding that compensates its own error, calibrated on a little text (Frantar et al., 2022).

Round to nearest (RTN) rounds every weight on its own. GPTQ rounds one input channel at a time and spreads each
rounding error over the channels not yet rounded, weighted by the inverse Hessian ``H = Σ x xᵀ`` of the layer's
inputs on calibration text, so the layer's *output* error ``‖(W - Q) X‖`` is what gets minimised. One shot: the
statistics come from the unquantized model, one forward pass over the calibration tokens.

It runs on the torch model before export and writes weights that lie exactly on the int4 grid of each block
(the same blocks, scales and zero points as ``passes/int4_weights.py``); that pass finds the grids and carries them
across exactly, as it does for a GGUF's Q4 blocks. The tied lm_head / embedding table is left to the pass.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from edgec.blockquant import round_to_grid, rtn_grid

WINDOWS, WINDOW = 32, 512  # 16K calibration tokens: ~1 minute of forward passes on 2 cores for a 135M model
DAMPING = 0.01  # of the mean Hessian diagonal, added to its diagonal (GPTQ's default)
COLUMNS_PER_STEP = 128  # GPTQ's lazy batch of columns: errors inside it update eagerly, the rest once per batch
Report = Callable[[int, int], None]  # (layers done, layers in all)


def calibration_text(path: str | Path | None) -> str:
    """The text GPTQ calibrates on: a file, or Python's own documentation (present in every CPython)."""
    if path is not None:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def calibration_windows(tokenizer, calib: str | Path | None, count: int, length: int) -> list[torch.Tensor]:
    """Up to ``count`` windows of ``length`` token ids of the calibration text (the whole text if shorter)."""
    ids = torch.tensor(tokenizer(calibration_text(calib))["input_ids"], dtype=torch.long)
    return [ids[i * length : (i + 1) * length] for i in range(min(count, len(ids) // length))] or [ids]


def gptq_weight(weight: torch.Tensor, hessian: torch.Tensor, block_size: int, symmetric: bool) -> torch.Tensor:
    """weight [out, in] (a torch Linear's), hessian [in, in] → weight rounded onto one int4 grid per block of
    ``block_size`` input channels. ``in`` must be a multiple of ``block_size``."""
    w = weight.detach().to(torch.float64).clone()
    h = hessian.to(torch.float64).clone()
    dead = torch.diag(h) == 0  # an input channel that never fired: its weights cannot matter
    h[dead, dead] = 1
    w[:, dead] = 0
    h += DAMPING * torch.diag(h).mean() * torch.eye(len(h), dtype=h.dtype)
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    rounded = torch.zeros_like(w)
    columns = w.shape[1]
    for start in range(0, columns, COLUMNS_PER_STEP):
        stop = min(start + COLUMNS_PER_STEP, columns)
        chunk, local = w[:, start:stop].clone(), inverse[start:stop, start:stop]
        errors = torch.zeros_like(chunk)
        for i in range(stop - start):
            if (start + i) % block_size == 0:  # a new block: its grid from the (already error-updated) weights
                scale, zero = rtn_grid(chunk[:, i : i + block_size], symmetric)
            q = round_to_grid(chunk[:, i], scale, zero, symmetric)
            rounded[:, start + i] = q
            error = (chunk[:, i] - q) / local[i, i]
            chunk[:, i:] -= error[:, None] * local[i, i:][None, :]
            errors[:, i] = error
        w[:, stop:] -= errors @ inverse[start:stop, stop:]
    return rounded.to(weight.dtype)


def linear_layers(causal_lm: torch.nn.Module, block_size: int, with_output: bool) -> dict[str, torch.nn.Linear]:
    """The Linear layers GPTQ rounds, whose input channels fill whole blocks: the output projection (lm_head, the
    embedding table when tied) only ``with_output`` — when the int4 pass stores it at 4 bits too."""
    output = causal_lm.get_output_embeddings()
    return {
        name: module
        for name, module in causal_lm.named_modules()
        if isinstance(module, torch.nn.Linear)
        and (with_output or module is not output)
        and module.in_features % block_size == 0
    }


def input_hessians(causal_lm: torch.nn.Module, layers: dict[str, torch.nn.Linear], windows: list[torch.Tensor]):
    """H = Σ x xᵀ / n over every token each layer sees, from forward passes of the unquantized model. Layers fed
    the same tensor (q/k/v, gate/up) share one H: the products, not the forward passes, are most of the cost."""
    hessians = {name: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for name, m in layers.items()}
    counts = dict.fromkeys(layers, 0)
    same_input: dict[str, str] = {}  # layer → the earlier layer that saw the very same input tensor
    last = {"input": None, "name": ""}

    def hook(name):
        def accumulate(module, inputs, output):
            if inputs[0] is last["input"]:
                same_input[name] = same_input.get(last["name"], last["name"])
                return
            last["input"], last["name"] = inputs[0], name
            x = inputs[0].detach().reshape(-1, module.in_features).float()
            hessians[name] += (x.T @ x).double()  # fp32 product, fp64 sum over windows
            counts[name] += len(x)

        return accumulate

    handles = [module.register_forward_hook(hook(name)) for name, module in layers.items()]
    body = getattr(causal_lm, causal_lm.base_model_prefix, causal_lm)  # the decoder without the lm_head: no logits
    output = next((name for name, m in layers.items() if m is causal_lm.get_output_embeddings()), None)
    try:
        with torch.no_grad():
            for ids in windows:
                hidden = body(ids[None])[0]
                if output is not None:  # the lm_head's input is the body's output
                    x = hidden.reshape(-1, hidden.shape[-1]).float()
                    hessians[output] += (x.T @ x).double()
                    counts[output] += len(x)
    finally:
        for handle in handles:
            handle.remove()
    averaged = {name: h / max(counts[name], 1) for name, h in hessians.items() if counts[name]}
    return {name: averaged[same_input.get(name, name)] for name in layers}


def gptq(
    causal_lm: torch.nn.Module,
    tokenizer,
    block_size: int,
    symmetric: bool,
    calib: str | Path | None = None,
    report: Report | None = None,
    with_output: bool = False,
) -> int:
    """Round the model's Linear weights in place with GPTQ; returns how many layers were rounded."""
    report = report or (lambda done, total: None)
    windows = calibration_windows(tokenizer, calib, WINDOWS, WINDOW)
    layers = linear_layers(causal_lm, block_size, with_output)
    report(0, len(layers) + 1)
    hessians = input_hessians(causal_lm, layers, windows)
    report(1, len(layers) + 1)
    with torch.no_grad():
        for done, (name, module) in enumerate(layers.items(), start=2):
            module.weight.copy_(gptq_weight(module.weight, hessians.pop(name), block_size, symmetric))
            report(done, len(layers) + 1)
    return len(layers)
