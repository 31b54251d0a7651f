"""A random Llama and a locally trained tokenizer, saved as a Hugging Face model folder that vLLM
loads offline (no hub). Needs `transformers` and `tokenizers` (both come with vLLM).

    build_tiny_llama(path)                              the test model: 2 layers, hidden 128
    build_tiny_llama(path, layers=8, hidden=512, heads=8, kv_heads=8, head_dim=64)   the bench model
"""

from __future__ import annotations

import os
import random


def build_tiny_llama(
    path: str,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 2,
    kv_heads: int = 2,
    head_dim: int = 64,
    intermediate: int = 256,
    vocab: int = 512,
    max_positions: int = 4096,
    seed: int = 0,
) -> str:
    """Writes the model to `path` (once: an existing config.json is kept) and returns `path`."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(400)]
    corpus = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(300)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    return path
