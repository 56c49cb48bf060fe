"""Tiny GGUF models (the llama.cpp engine): a transformers Llama written as a GGUF file llama.cpp loads."""

from __future__ import annotations

from pathlib import Path

import torch


def _hf_rope_to_gguf(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF stores Llama's q/k rows for rotate-half RoPE; GGUF's llama architecture wants them interleaved
    (llama.cpp's convert_hf_to_gguf.py permutes them the same way)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: Path, *, eos_id: int | None = None, readable: bool = False, matrices: str = "F32") -> Path:
    """Write a transformers Llama (tiny_llama) as a float32 GGUF file llama.cpp loads, with a vocabulary of one
    placeholder string per id (the tests feed ids, never text). llama.cpp's logits for it match the torch model's.
    `readable`: a vocabulary transformers' GGUF reader also takes (letters and one merge of two of them), so the
    file converts for torch (models.convert_gguf) in a fraction of a second. `matrices`: the layers' matrices and
    the LM head quantised by the gguf package to that type (Q4_0, Q5_0, Q8_0...; rows of whole blocks)."""
    import gguf

    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"] if getattr(c, "rope_parameters", None) else c.rope_theta)
    writer.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    letters = [chr(ord("a") + i) for i in range(c.vocab_size - 1)] + ["ab"]
    writer.add_token_list(letters if readable else [f"t{i}" for i in range(c.vocab_size)])
    writer.add_token_types([gguf.TokenType.NORMAL] * c.vocab_size)
    writer.add_token_merges(["a b"] if readable else ["t1 t2"])  # llama.cpp requires the key; the tests never tokenise text
    if eos_id is not None:
        writer.add_eos_token_id(eos_id)
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])

    def add_matrix(name: str, w) -> None:
        if matrices == "F32" or w.ndim != 2:
            return writer.add_tensor(name, w)
        kind = gguf.GGMLQuantizationType[matrices]
        writer.add_tensor(name, gguf.quants.quantize(w, kind), raw_dtype=kind)

    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        q = _hf_rope_to_gguf(torch.from_numpy(sd[p + "self_attn.q_proj.weight"]), c.num_attention_heads).numpy()
        k = _hf_rope_to_gguf(torch.from_numpy(sd[p + "self_attn.k_proj.weight"]), c.num_key_value_heads).numpy()
        for name, w in (("attn_norm", sd[p + "input_layernorm.weight"]), ("attn_q", q), ("attn_k", k),
                        ("attn_v", sd[p + "self_attn.v_proj.weight"]), ("attn_output", sd[p + "self_attn.o_proj.weight"]),
                        ("ffn_norm", sd[p + "post_attention_layernorm.weight"]), ("ffn_gate", sd[p + "mlp.gate_proj.weight"]),
                        ("ffn_up", sd[p + "mlp.up_proj.weight"]), ("ffn_down", sd[p + "mlp.down_proj.weight"])):
            add_matrix(f"blk.{i}.{name}.weight", w)
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])
    add_matrix("output.weight", sd["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
