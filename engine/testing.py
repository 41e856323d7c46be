"""Tiny, deterministic, random-weight models for tests and smoke runs (no download, builds in about a second).

``build_tiny_model(folder, arch="llama")`` writes a Hugging Face folder — config.json, model.safetensors, a byte-level
BPE tokenizer trained in-process with a ChatML chat template — that every part of kvchat loads like a real model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_CORPUS = [
    "Hello, I ordered a blue jacket last week and it has not arrived yet. Can you check my order status?",
    "Of course! Could you please share your order number and the email address on the account?",
    "I would like a refund for a damaged item. The box was crushed and the screen is cracked.",
    "Our return policy allows returns within 30 days of delivery with the original receipt.",
    "Crème brûlée, café, naïve résumé — ünïcödé and emoji 😀🎉👍🏽 and 日本語 too.",
    "Thank you for contacting support. Is there anything else I can help you with today?",
    "Please reset my password; I cannot log in to my account since yesterday.",
    "Shipping usually takes 3-5 business days. Express shipping costs $12.99.",
]

_ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    "mistral": {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": None},
    "qwen2": {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
    "qwen3": {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "head_dim": 16},
}


def build_tokenizer(folder: Path, vocab_size: int = 384) -> Any:
    """Train a byte-level BPE on a small support-chat corpus and save it (with ChatML) to ``folder``."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(_CORPUS * 4, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHATML_TEMPLATE
    hf.save_pretrained(folder)
    return hf


def build_tiny_model(
    folder: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_position_embeddings: int = 2048,
    suppress_eos: bool = False,
    **overrides: Any,
) -> Path:
    """Write a random ``arch`` model + tokenizer to ``folder`` and return it. fp32 weights, seeded.

    ``suppress_eos`` zeroes the EOS token's (tied) embedding row, so its logit is 0 while others spread around it:
    greedy replies then run to ``max_tokens`` instead of stopping after a few random tokens.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    base = dict(_ARCH_CONFIGS[arch])
    model_type = base.pop("model_type")
    params: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        **base,
        **overrides,
    }
    config = AutoConfig.for_model(model_type, **params)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # NOTE: a wider init than HF's default 0.02 makes the logits spread out, so greedy ties (which would make
            # exact-equality tests flaky for reasons that have nothing to do with caching) are vanishingly rare.
            if "norm" in name:
                p.uniform_(0.8, 1.2)
            else:
                p.normal_(0.0, 0.15 if p.dim() > 1 else 0.1)
        if suppress_eos:
            model.get_output_embeddings().weight[tokenizer.eos_token_id].zero_()
    model.save_pretrained(folder)
    return folder
