"""Test support: tiny random-weight models, family-faithful tokenizers, and fault injection.

``build_tiny_model(folder, arch="llama")`` writes a Hugging Face folder — config.json, model.safetensors, a byte-level
BPE tokenizer trained in-process with a ChatML chat template — that every part of kvchat loads like a real model
(no download, builds in about a second). ``build_family_tokenizer(folder, family)`` writes a small tokenizer with the
special tokens and chat template of one supported model family. ``Faults(...).install(engine)`` makes chosen
requests fail inside a loaded engine's forward pass or sampler, so tests can check that only they fail.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from engine.llm_engine import LLMEngine
    from engine.model_runner import BatchItem, ModelRunner
    from engine.sampler import SamplerState

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


@dataclass(frozen=True, slots=True)
class TokenizerFamily:
    """What a model family's tokenizer looks like to the chat template: its control tokens and its template."""

    template: str
    specials: tuple[str, ...]  # special (control) tokens; the first ones are named below
    bos: str
    eos: str
    sentencepiece: bool = False  # Metaspace ("▁") BPE like Llama 2 / Mistral, else byte-level BPE
    plain_added: tuple[str, ...] = ()  # added tokens that are not special (Qwen3's <think>)


_LLAMA3_TEMPLATE = (
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
_LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
_MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)
_CHATML_DEFAULT_SYSTEM = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nDEFAULT<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_QWEN3_TEMPLATE = (
    "{%- for message in messages %}{%- if message.role == 'assistant' %}{%- set content = message.content %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
    "{%- endif %}"
)
_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# NOTE: the templates and control tokens of the real models (abridged where they only add tools or reasoning).
FAMILIES: dict[str, TokenizerFamily] = {
    "llama2": TokenizerFamily(_LLAMA2_TEMPLATE, ("<unk>", "<s>", "</s>"), "<s>", "</s>", sentencepiece=True),
    "llama3": TokenizerFamily(
        _LLAMA3_TEMPLATE,
        (
            *("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
            *(f"<|reserved_special_token_{i}|>" for i in range(4)),
        ),
        "<|begin_of_text|>",
        "<|eot_id|>",
    ),
    "mistral": TokenizerFamily(
        _MISTRAL_TEMPLATE, ("<unk>", "<s>", "</s>", "[INST]", "[/INST]"), "<s>", "</s>", sentencepiece=True
    ),
    "qwen2": TokenizerFamily(
        _CHATML_DEFAULT_SYSTEM.replace("DEFAULT", "You are a helpful assistant."),
        (*_CHATML, "<|object_ref_start|>", "<|vision_start|>", "<|fim_prefix|>"),
        "<|im_start|>",
        "<|im_end|>",
    ),
    "qwen3": TokenizerFamily(
        _QWEN3_TEMPLATE,
        (*_CHATML, "<|object_ref_start|>", "<|vision_start|>", "<|fim_prefix|>"),
        "<|im_start|>",
        "<|im_end|>",
        plain_added=("<think>", "</think>", "<tool_call>", "</tool_call>"),
    ),
    "smollm2": TokenizerFamily(
        _CHATML_DEFAULT_SYSTEM.replace(
            "DEFAULT", "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
        ),
        (*_CHATML, "<repo_name>", "<reponame>", "<file_sep>", "<filename>", "<gh_stars>", "<jupyter_output>"),
        "<|im_start|>",
        "<|im_end|>",
    ),
}


def build_family_tokenizer(folder: str | Path, family: str, vocab_size: int = 400) -> Path:
    """Write a small tokenizer with ``family``'s control tokens, BOS/EOS and chat template to ``folder``."""
    import string

    from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    folder = Path(folder)
    if spec.sentencepiece:
        raw = RawTokenizer(models.BPE(unk_token="<unk>"))
        raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        raw.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(spec.specials),
            initial_alphabet=list(string.printable),  # NOTE: no byte fallback: every ASCII character gets a token
            show_progress=False,
        )
    else:
        raw = RawTokenizer(models.BPE())
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        raw.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(spec.specials),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    raw.train_from_iterator(_CORPUS * 4, trainer)
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.plain_added])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=spec.bos, eos_token=spec.eos, clean_up_tokenization_spaces=False
    )
    hf.add_special_tokens({"additional_special_tokens": [t for t in spec.specials if t not in (spec.bos, spec.eos)]})
    hf.chat_template = spec.template
    hf.save_pretrained(folder)
    return folder


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


_GGUF_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tiny_gguf(path: str | Path, *, seed: int = 0, hidden_size: int = 64) -> Path:
    """Write a random one-layer Llama GGUF (fp32 tensors, a byte-level BPE vocabulary of 261 tokens, a ChatML
    template) to ``path``: what the converter reads from SmolLM2's GGUF, small enough to convert in seconds."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    path = Path(path)
    heads, ff = 2, hidden_size * 2
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *bytes_to_unicode().values(), "\u0120t", "he"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden_size)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden_size // heads)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))  # 3: control (special), 1: normal
    writer.add_token_merges(["\u0120 t", "h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(0)
    writer.add_chat_template(_GGUF_CHAT_TEMPLATE)
    rng = np.random.default_rng(seed)
    head_dim = hidden_size // heads
    shapes = {
        "token_embd.weight": (len(tokens), hidden_size),
        "blk.0.attn_q.weight": (hidden_size, hidden_size),
        "blk.0.attn_k.weight": (head_dim, hidden_size),
        "blk.0.attn_v.weight": (head_dim, hidden_size),
        "blk.0.attn_output.weight": (hidden_size, hidden_size),
        "blk.0.ffn_gate.weight": (ff, hidden_size),
        "blk.0.ffn_up.weight": (ff, hidden_size),
        "blk.0.ffn_down.weight": (hidden_size, ff),
    }
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.15).astype(np.float32))
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        writer.add_tensor(name, np.ones(hidden_size, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


class InjectedFault(RuntimeError):
    """What an injected failure raises (never raised outside tests)."""


@dataclass(slots=True)
class Faults:
    """Failures to inject into one engine, chosen by request id or token id; the sets may change while it runs.

    * ``forward_requests``: a forward pass raises (after writing its K/V) whenever one of these requests is in it;
    * ``forward_tokens``: a forward pass raises whenever it computes one of these ids as a prompt token (a poisoned
      prompt; generated tokens never trigger it, so a request cannot be poisoned by what the model says);
    * ``nan_logits``: the logits row of these requests comes back all NaN (a model that blew up on their input);
    * ``corrupt_kv``: a forward pass writes NaN into the K/V slots it computed for these requests, then raises;
    * ``sample_requests``: sampling the row of these requests raises;
    * ``step_delay_s``: every forward pass takes this much longer (a slow model, so a test can hold the engine full
      without depending on how fast this CPU is);
    * ``disk_removal_delay_s``: deleting each disk-tier file takes this much longer (a slow disk, so a test can show
      that disk work never holds up the step loop).

    ``forward_batches`` records the request ids of every forward pass, in order, for assertions.
    """

    forward_requests: set[str] = field(default_factory=set)
    forward_tokens: set[int] = field(default_factory=set)
    nan_logits: set[str] = field(default_factory=set)
    corrupt_kv: set[str] = field(default_factory=set)
    sample_requests: set[str] = field(default_factory=set)
    step_delay_s: float = 0.0
    disk_removal_delay_s: float = 0.0
    disk_removals: int = 0
    forward_batches: list[tuple[str, ...]] = field(default_factory=list)
    _runner: ModelRunner | None = field(default=None, repr=False)

    def install(self, engine: LLMEngine) -> Faults:
        """Hook into a loaded engine's model runner, sampler and disk tier (``engine.load()`` or ``start()`` first)."""
        # NOTE: the one place that reaches into the engine's parts; the hooks are their documented test seams.
        runner, sampler = engine._runner, engine._sampler
        if runner is None or sampler is None:
            raise RuntimeError("load the engine before installing faults")
        runner.fault_hook = self._after_forward
        sampler.fault_hook = self._before_sample
        engine.core.cache.on_disk_removal(self._before_disk_removal)
        self._runner = runner
        return self

    def clear(self) -> None:
        """Inject nothing more (the record of forward passes is kept)."""
        for chosen in (self.forward_requests, self.nan_logits, self.corrupt_kv, self.sample_requests):
            chosen.clear()
        self.forward_tokens.clear()

    def _after_forward(self, items: list[BatchItem], logits: torch.Tensor) -> None:
        self.forward_batches.append(tuple(item.request_id for item in items))
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)
        for item in items:
            if item.request_id in self.corrupt_kv:
                self._write_nan_kv(item)
                raise InjectedFault(f"injected NaN K/V for request {item.request_id}")
            if item.request_id in self.forward_requests:
                raise InjectedFault(f"injected forward failure for request {item.request_id}")
            if item.prompt and self.forward_tokens.intersection(item.token_ids):
                raise InjectedFault(f"injected forward failure on a poisoned token of request {item.request_id}")
        row = 0
        for item in items:
            n = len(item.token_ids) if item.verify else int(item.need_logits)  # (a verify item: a row per token)
            if n and item.request_id in self.nan_logits:
                logits[row : row + n] = float("nan")
            row += n

    def _write_nan_kv(self, item: BatchItem) -> None:
        assert self._runner is not None
        bs = self._runner.block_size
        for pos in range(item.start_pos, item.start_pos + len(item.token_ids)):
            self._runner.kv_pool[:, :, item.block_table[pos // bs], pos % bs] = float("nan")

    def _before_disk_removal(self, name: str) -> None:
        self.disk_removals += 1
        if self.disk_removal_delay_s > 0:
            time.sleep(self.disk_removal_delay_s)

    def _before_sample(self, state: SamplerState) -> None:
        if state.request_id in self.sample_requests:
            raise InjectedFault(f"injected sampling failure for request {state.request_id}")
