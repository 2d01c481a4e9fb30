"""The KVAttention op on the torch side: a custom op for tracing, its eager meaning, its ONNX translation.

transformers' attention interface routes every layer's attention here (``register_attention``), so the
traced graph holds exactly one ``ai.edgec::KVAttention`` node per layer, whatever the model family.
"""

from __future__ import annotations

import torch
from onnxscript import values as onnxscript_values
from transformers import AttentionInterface

from edgec.kvcache import function

ATTENTION_NAME = "edgec_kv"


@torch.library.custom_op("edgec::kv_attention", mutates_args=())
def kv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position_ids: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pos_cache: torch.Tensor,
    scale: float,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Eager meaning, identical to edgec/kvcache/reference.py (used when the step module runs in torch)."""
    batch, num_heads, seq, head_dim = q.shape
    num_kv_heads, capacity = k_cache.shape[1], k_cache.shape[2]
    slots = torch.remainder(position_ids, capacity)  # [B,T]
    index = slots[:, None, :, None].expand(batch, num_kv_heads, seq, head_dim)
    k_cache = k_cache.scatter(2, index, k)
    v_cache = v_cache.scatter(2, index, v)
    pos_cache = pos_cache.scatter(
        2, slots[:, None, :].expand(batch, num_kv_heads, seq), position_ids[:, None, :].expand(batch, num_kv_heads, seq)
    )
    group = num_heads // num_kv_heads
    q_grouped = q.reshape(batch, num_kv_heads, group * seq, head_dim)
    scores = q_grouped @ k_cache.transpose(2, 3) * scale
    query_pos = position_ids.repeat(1, group)[:, None, :, None]
    key_pos = pos_cache[:, :, None, :]
    valid = (key_pos >= 0) & (key_pos <= query_pos)
    if window > 0:
        valid &= key_pos > query_pos - window
    probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
    out = (probs @ v_cache).reshape(batch, num_heads, seq, head_dim).transpose(1, 2).contiguous()
    return out, k_cache, v_cache, pos_cache


@kv_attention.register_fake
def _(q, k, v, position_ids, k_cache, v_cache, pos_cache, scale, window):
    batch, num_heads, seq, head_dim = q.shape
    return (
        q.new_empty(batch, seq, num_heads, head_dim),
        torch.empty_like(k_cache),
        torch.empty_like(v_cache),
        torch.empty_like(pos_cache),
    )


_KV_ATTENTION_OP = onnxscript_values.Op(
    onnxscript_values.Opset(function.DOMAIN, function.OPSET_VERSION), function.OP_TYPE, function.make_schema()
)


def kv_attention_onnx(q, k, v, position_ids, k_cache, v_cache, pos_cache, scale: float, window: int):
    """ONNX translation: one plain ai.edgec::KVAttention node; its function body is attached after export."""
    return _KV_ATTENTION_OP(q, k, v, position_ids, k_cache, v_cache, pos_cache, scale=scale, window=window)


ONNX_TRANSLATIONS = {torch.ops.edgec.kv_attention.default: kv_attention_onnx}


class CacheRouter:
    """Carries the flat cache state into the attention function and collects the new state per layer."""

    def __init__(self, caches: tuple[torch.Tensor, ...], windows: list[int]) -> None:
        self.caches = caches
        self.windows = windows
        self.new_caches: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.caches[3 * layer_idx], self.caches[3 * layer_idx + 1], self.caches[3 * layer_idx + 2]

    def flat_new(self) -> list[torch.Tensor]:
        return [tensor for layer in sorted(self.new_caches) for tensor in self.new_caches[layer]]


def edgec_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention-interface entry: replaces sdpa/eager with the KVAttention op."""
    router: CacheRouter = kwargs["edgec_cache"]
    position_ids = kwargs["position_ids"]
    layer_idx = module.layer_idx
    traced_window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None) or 0
    if traced_window != router.windows[layer_idx]:  # the cache layout was planned from the config: they must agree
        raise RuntimeError(
            f"layer {layer_idx}: model uses window {traced_window}, config gave {router.windows[layer_idx]}"
        )
    if kwargs.get("softcap"):  # load.check_model_features refuses such models; never drop it silently
        raise RuntimeError(f"layer {layer_idx}: attention logit soft-capping is not implemented by KVAttention")
    k_cache, v_cache, pos_cache = router.layer(layer_idx)
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    out, k_new, v_new, pos_new = kv_attention(
        query, key, value, position_ids, k_cache, v_cache, pos_cache, scale, router.windows[layer_idx]
    )
    router.new_caches[layer_idx] = (k_new, v_new, pos_new)
    return out, None


def register_attention() -> str:
    """Register the attention function with transformers (idempotent); returns its implementation name."""
    AttentionInterface.register(ATTENTION_NAME, edgec_attention)
    return ATTENTION_NAME
