"""A tiny Llama written as a GGUF file whose linear layers use every block type edgec imports exactly, mixed inside
the projections the graph fuses (q|k|v, gate|up), so one build exercises every path of the exact import in seconds.

Hidden size 256 and intermediate 512: K-quants need rows that are whole 256-value super-blocks. Q4_0/Q4_1/Q5_0/
Q5_1/Q8_0 blocks come from the gguf library's own quantizer; K-quant blocks (which it only dequantizes) are random
bytes with sensible fp16 steps — every byte pattern is a valid block.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
# per layer: (attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down)
MIXED = (
    ("Q5_0", "Q4_1", "Q8_0", "Q4_K", "Q4_K", "Q5_K", "Q6_K"),  # 8-bit codes with offsets; Q6_K's blocks of 16
    ("Q4_0", "Q4_0", "Q4_1", "Q5_1", "Q6_K", "Q4_K", "Q5_K"),  # 4-bit codes with offsets; 16- and 32-blocks mixed
)
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _shapes() -> dict[str, tuple[int, int]]:
    """[rows (outputs), columns (inputs)] of each projection."""
    head_dim = HIDDEN // HEADS
    return {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (KV_HEADS * head_dim, HIDDEN),
        "attn_v": (KV_HEADS * head_dim, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (INTERMEDIATE, HIDDEN),
        "ffn_up": (INTERMEDIATE, HIDDEN),
        "ffn_down": (HIDDEN, INTERMEDIATE),
    }


def quantized(rng: np.random.Generator, type_name: str, rows: int, columns: int, scale: float) -> np.ndarray:
    """uint8 [rows, bytes per row]: random weights of about ``scale`` in ``type_name``'s blocks."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        return gguf.quants.quantize(rng.normal(0, scale, (rows, columns)).astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * columns // block, size), dtype=np.uint8)
    steps = rng.uniform(0.5, 1.0, (len(raw), 2)).astype(np.float16)
    if type_name == "Q6_K":  # d at byte 208, 16 int8 sub-scales (codes -32..31) before it
        steps[:, 0] *= scale / 32 / 64
        raw[:, 192:208] = rng.integers(1, 64, (len(raw), 16), dtype=np.uint8)
        raw[:, 208:210] = steps[:, :1].view(np.uint8)
    else:  # d and dmin first, then 6-bit sub-scales and minima (codes 0..15 or 0..31)
        top = 16 if type_name == "Q4_K" else 32
        steps *= np.float16(2 * scale / top / 63)
        raw[:, :4] = steps.view(np.uint8)
    return raw.reshape(rows, -1)


def write_tiny_llama_gguf(path: Path, tokenizer, mixed=MIXED, table_type: str = "Q8_0", seed: int = 0) -> Path:
    """A tied tiny Llama (the table ``table_type``) with ``tokenizer``'s vocabulary and merges."""
    import gguf

    rng = np.random.default_rng(seed)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = [token for token, _ in sorted(spec["vocab"].items(), key=lambda item: item[1])]
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in spec["merges"]]
    special = set(tokenizer.all_special_tokens)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-mixed")
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_chat_template(tokenizer.chat_template)

    def add(name: str, type_name: str, rows: int, columns: int, scale: float) -> None:
        data = quantized(rng, type_name, rows, columns, scale)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[type_name])

    add("token_embd.weight", table_type, len(tokens), HIDDEN, 0.5)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for layer, types in enumerate(mixed):
        for projection, type_name in zip(PROJECTIONS, types, strict=True):
            rows, columns = _shapes()[projection]
            add(f"blk.{layer}.{projection}.weight", type_name, rows, columns, 0.6 / np.sqrt(columns))
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", rng.uniform(0.8, 1.2, HIDDEN).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
