"""AWQ: activation-aware scaling before round to nearest, calibrated on a little text (Lin et al., 2023).

A few input channels of each linear layer carry much larger activations than the rest; their weights matter most,
yet round to nearest (RTN) gives every weight of a block the same step. AWQ multiplies those input channels' weights
by ``s`` (so they use more of the grid) and divides the op that produces the input by ``s`` — the RMSNorm's weight
for q/k/v and gate/up, up_proj's rows for down_proj, v_proj's rows for o_proj (attention is linear in V) — so the
unrounded model computes exactly what it did. Per group of layers sharing one input, ``s = mean|x|^α`` with α
searched on a grid for the smallest output error of the rounded layers, ``trace((W - Q) H (W - Q)ᵀ)`` with
``H = Σ x xᵀ / n`` of the layer's inputs (α = 0 is RTN itself, so the search never does worse on the calibration
text). Then each block's clipping range is searched the same way (not for q/k: attention scores amplify it).

Only a few numbers per channel are fitted (no weight is moved against others, as GPTQ does), which is why the
result carries over from the calibration text to other text. It runs on the torch model before export and leaves
fp32 weights that the int4 pass rounds exactly as the search simulated (the grids of ``edgec.blockquant.rtn_grid``).
The tied lm_head / embedding table is left to the pass (its input cannot be rescaled without changing the table).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgec.blockquant import rtn
from edgec.gptq import Report, calibration_windows
from edgec.shape import ModelShape

WINDOWS, WINDOW = 32, 512  # 16K calibration tokens, as GPTQ
GRID = 20  # α ∈ {0, 0.05, ..., 0.95}
SHRINKS = 10  # clipping ranges tried: 1.0, 0.95, ..., 0.55 of a block's absmax
NO_CLIP = ("q_proj", "k_proj", "qkv_proj")


@dataclass
class Group:
    """Linear layers that read one input, and the op producing it: a norm, or rows of a linear layer."""

    previous: torch.nn.Module
    linears: dict[str, torch.nn.Linear]
    rows: slice | None = None  # of a previous linear layer (a fused qkv / gate_up): the rows that make the input
    repeat: int = 1  # o_proj: query heads per KV head (each KV head's channels feed ``repeat`` heads' inputs)
    head_dim: int = 1

    def tie(self, values: torch.Tensor) -> torch.Tensor:
        """Per input channel → the same value on the channels that one previous row feeds (their mean)."""
        v = values.reshape(-1, self.repeat, self.head_dim)
        return v.mean(1, keepdim=True).expand_as(v).reshape(-1)

    def previous_rows(self, values: torch.Tensor) -> torch.Tensor:
        """Per input channel (tied) → per row of the previous op."""
        return values.reshape(-1, self.repeat, self.head_dim)[:, 0].reshape(-1)


def output_error(delta: torch.Tensor, hessian: torch.Tensor) -> float:
    """Σ over calibration tokens of ‖delta · x‖², per token: trace(delta H deltaᵀ)."""
    return float(((delta @ hessian) * delta).sum())


def best_scale(
    weight: torch.Tensor, hessian: torch.Tensor, magnitude: torch.Tensor, block_size: int, symmetric: bool
) -> torch.Tensor:
    """The per-input-channel scale s (weight · diag(s) is rounded, 1/s goes to the input) of the smallest output
    error; ones when no α > 0 beats plain round to nearest."""
    best, chosen = output_error(weight - rtn(weight, block_size, symmetric), hessian), torch.ones_like(magnitude)
    base = magnitude.clamp(min=1e-4)
    for step in range(1, GRID):
        scale = base ** (step / GRID)
        scale = scale / (scale.max() * scale.min()).sqrt()
        error = output_error(weight - rtn(weight * scale, block_size, symmetric) / scale, hessian)
        if error < best:
            best, chosen = error, scale
    return chosen


def clip(weight: torch.Tensor, hessian: torch.Tensor, block_size: int, symmetric: bool) -> torch.Tensor:
    """weight [out, in] with each block clamped to ±(the fraction of its absmax) whose rounding gives the smallest
    error in that block's part of the output (H's diagonal block); the pass's grid then spans the clamped range."""
    out, columns = weight.shape
    blocks = weight.reshape(out, -1, block_size)
    count = columns // block_size
    h = torch.stack(
        [hessian[i * block_size : (i + 1) * block_size, i * block_size : (i + 1) * block_size] for i in range(count)]
    )
    absmax = blocks.abs().amax(-1, keepdim=True)
    best_error, best_limit = None, absmax
    for step in range(SHRINKS):
        limit = absmax * (1 - step / (2 * SHRINKS))
        clamped = torch.maximum(torch.minimum(blocks, limit), -limit)
        delta = blocks - rtn(clamped.reshape(out, columns), block_size, symmetric).reshape(blocks.shape)
        error = torch.einsum("obk,bkl,obl->ob", delta, h, delta)[..., None]
        if best_error is None:
            best_error = error
            continue
        better = error < best_error
        best_error, best_limit = torch.where(better, error, best_error), torch.where(better, limit, best_limit)
    return torch.maximum(torch.minimum(blocks, best_limit), -best_limit).reshape(out, columns)


def layer_groups(causal_lm: torch.nn.Module, block_size: int) -> list[list[Group]]:
    """Per decoder layer, its groups whose scaling folds exactly into the previous op (Llama, Mistral, Qwen2,
    Phi-3, Gemma 3 layouts); a group whose inputs do not fill whole blocks is left to round to nearest."""
    shape = ModelShape.from_config(causal_lm.config)
    heads, kv_heads, head_dim = shape.heads, shape.kv_heads, shape.head_dim
    body = getattr(causal_lm, causal_lm.base_model_prefix, causal_lm)
    result = []
    for layer in body.layers:
        attention, mlp = layer.self_attn, layer.mlp
        # Gemma's sandwich norms: the MLP reads pre_feedforward_layernorm (post_attention_layernorm ends attention)
        mlp_norm = getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm
        groups = []
        if hasattr(attention, "qkv_proj"):  # Phi-3: fused projections
            q, kv = heads * head_dim, kv_heads * head_dim
            groups += [
                Group(layer.input_layernorm, {"qkv_proj": attention.qkv_proj}),
                Group(
                    attention.qkv_proj,
                    {"o_proj": attention.o_proj},
                    slice(q + kv, q + 2 * kv),
                    heads // kv_heads,
                    head_dim,
                ),
            ]
        else:
            names = ("q_proj", "k_proj", "v_proj")
            groups.append(Group(layer.input_layernorm, {name: getattr(attention, name) for name in names}))
            if not hasattr(attention, "v_norm"):  # a norm on V would make o_proj's input nonlinear in its rows
                groups.append(Group(attention.v_proj, {"o_proj": attention.o_proj}, None, heads // kv_heads, head_dim))
        if hasattr(mlp, "gate_up_proj"):
            half = mlp.gate_up_proj.out_features // 2
            groups += [
                Group(mlp_norm, {"gate_up_proj": mlp.gate_up_proj}),
                Group(mlp.gate_up_proj, {"down_proj": mlp.down_proj}, slice(half, 2 * half)),
            ]
        else:
            groups += [
                Group(mlp_norm, {"gate_proj": mlp.gate_proj, "up_proj": mlp.up_proj}),
                Group(mlp.up_proj, {"down_proj": mlp.down_proj}),
            ]
        result.append([g for g in groups if next(iter(g.linears.values())).in_features % block_size == 0])
    return result


def input_statistics(causal_lm: torch.nn.Module, groups: list[Group], windows: list[torch.Tensor], report):
    """Per group: (mean |x| per input channel, H = Σ x xᵀ / n), from forward passes of the unquantized model."""
    sums = {id(g): [0.0, 0.0, 0] for g in groups}

    def hook(group):
        def accumulate(module, inputs):
            x = inputs[0].detach().reshape(-1, module.in_features).float()
            entry = sums[id(group)]
            entry[0] = entry[0] + x.abs().sum(0).double()
            entry[1] = entry[1] + (x.T @ x).double()  # fp32 product, fp64 sum over windows
            entry[2] += len(x)

        return accumulate

    handles = [next(iter(g.linears.values())).register_forward_pre_hook(hook(g)) for g in groups]
    body = getattr(causal_lm, causal_lm.base_model_prefix, causal_lm)  # no logits needed
    try:
        with torch.no_grad():
            for done, ids in enumerate(windows, start=1):
                body(ids[None])
                report(done)
    finally:
        for handle in handles:
            handle.remove()
    return {id(g): (s[0] / max(s[2], 1), s[1] / max(s[2], 1)) for g, s in ((g, sums[id(g)]) for g in groups)}


def norm_offset(norm: torch.nn.Module) -> float:
    """1 for a norm that multiplies by (1 + weight) (Gemma), 0 for one that multiplies by weight."""
    saved = norm.weight.detach().clone()
    with torch.no_grad():
        norm.weight.zero_()
        probe = norm(torch.ones(1, saved.numel(), dtype=saved.dtype))
        norm.weight.copy_(saved)
    return 1.0 if probe.abs().sum() > 0 else 0.0


def fold(group: Group, scale: torch.Tensor) -> None:
    """Input channels of the group's layers times ``scale``, the op producing them divided by it: exact."""
    scale = scale.float()
    with torch.no_grad():
        for linear in group.linears.values():
            linear.weight.mul_(scale[None, :].to(linear.weight.dtype))
        previous = group.previous
        if isinstance(previous, torch.nn.Linear):
            rows = group.rows or slice(0, previous.out_features)
            divisor = group.previous_rows(scale)
            previous.weight[rows].div_(divisor[:, None].to(previous.weight.dtype))
            if previous.bias is not None:
                previous.bias[rows].div_(divisor.to(previous.bias.dtype))
        else:
            offset = norm_offset(previous)
            previous.weight.copy_((previous.weight.float() + offset) / scale - offset)


def awq(
    causal_lm: torch.nn.Module,
    tokenizer,
    block_size: int,
    symmetric: bool,
    calib=None,
    report: Report | None = None,
) -> int:
    """Scale (and clip) the model's Linear weights in place for int4 round to nearest; returns how many layers."""
    report = report or (lambda done, total: None)
    windows = calibration_windows(tokenizer, calib, WINDOWS, WINDOW)
    layers = layer_groups(causal_lm, block_size)
    total = len(windows) + len(layers)
    report(0, total)
    statistics = input_statistics(causal_lm, [g for gs in layers for g in gs], windows, lambda n: report(n, total))
    for done, groups in enumerate(layers, start=len(windows) + 1):
        for group in groups:
            magnitude, hessian = (t.float() for t in statistics.pop(id(group)))
            weight = torch.cat([linear.weight.detach().float() for linear in group.linears.values()])
            scale = best_scale(weight, hessian, group.tie(magnitude), block_size, symmetric)
            fold(group, scale)
            scaled_hessian = hessian / scale[:, None] / scale[None, :]  # of the input x / s the layers now see
            with torch.no_grad():
                for name, linear in group.linears.items():
                    if name not in NO_CLIP:
                        clipped = clip(linear.weight.detach().float(), scaled_hessian, block_size, symmetric)
                        linear.weight.copy_(clipped.to(linear.weight.dtype))
        report(done, total)
    return sum(len(g.linears) for groups in layers for g in groups)
