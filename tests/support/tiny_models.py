"""Tiny random Llama models with a WordLevel tokenizer, for running real vLLM on the CPU.

Nothing is downloaded: the weights are random (seeded) and the tokenizer maps "w<i>" words to ids.
The CPU attention backend needs head_dim >= 32 and a block size that is a multiple of 32.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def build_tiny_llama(
    directory: Path,
    hidden_size: int = 64,
    num_heads: int = 2,
    num_kv_heads: int = 2,
    num_layers: int = 2,
    vocab_size: int = 1000,
    intermediate_size: int = 128,
    max_position: int = 4096,
    seed: int = 0,
) -> Path:
    """Write a random Llama and its tokenizer to ``directory`` (once; reused if present)."""
    marker = directory / "kvsidecar-model.json"
    spec = {
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "num_layers": num_layers,
        "vocab_size": vocab_size,
        "intermediate_size": intermediate_size,
        "max_position": max_position,
        "seed": seed,
    }
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return directory
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", model_max_length=max_position
    )
    fast.save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Larger-than-default weights make the logits depend visibly on the context, so a wrong
        # KV cache changes the greedy output (the negative control relies on it).
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    marker.write_text(json.dumps(spec))
    return directory


def prompt_words(length: int, seed: int) -> str:
    """A prompt of ``length`` tokens."""
    import random

    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(3, 1000)}" for _ in range(length))


def kv_cache_config(config: Any, num_blocks: int, layout: str = "LBHNC") -> Any:
    """The KV cache of ``build_tiny_llama``'s default model as vLLM's CPU backend allocates it: two
    full-attention layers of ``num_blocks`` blocks (32 tokens, 2 heads of 32, float32) in one tensor.
    Used by the shim's tests and ``bench.shim_step``."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32)
    block_stride = spec.page_size_bytes
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=num_blocks * block_stride * len(layers),
                layers=layers,
                layer_stride=num_blocks * block_stride,
                block_stride=block_stride,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec)],
        kv_cache_layout=layout,
    )
