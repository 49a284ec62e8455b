"""Small models and prompts the tests build for themselves."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama


def hf_greedy(model: HFLlama, prompt: list[int], num_tokens: int) -> list[int]:
    """Pure argmax with HF's own KV cache: the reference (no EOS handling, no generate() logic)."""
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True)
    tokens: list[int] = []
    for _ in range(num_tokens):
        next_id = int(out.logits[0, -1].argmax())
        tokens.append(next_id)
        out = model(torch.tensor([[next_id]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def save_random_hf_model(path: Path, **overrides: object) -> HFLlama:
    config = LlamaConfig(vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=32,  # explicit, != 96 / 6
                         max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         eos_token_id=1, bos_token_id=0)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = HFLlama(config).eval()
    with torch.no_grad():
        # HF's init (std 0.02) makes attention nearly uniform, so positions (and RoPE bugs) would
        # barely change the output; sharpen it so the comparison can catch them.
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(12.0)
            layer.self_attn.k_proj.weight.mul_(12.0)
    model.save_pretrained(path)
    return model


def prompts_for(vocab: int, lens: list[int]) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


