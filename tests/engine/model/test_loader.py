"""resolve_model / fingerprint / error paths, on tiny folders made here; the real SmolLM2 GGUF is marked slow."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from engine.errors import ModelLoadError
from engine.model import kernels, prefill_attention
from engine.model.loader import DEFAULT_MODEL, fingerprint, gguf_cache_key, locate_model, resolve_model
from engine.model.spec import ModelSpec
from engine.model_runner import BatchItem, ModelRunner
from engine.testing import build_tiny_gguf

TINY = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 64,
}


@pytest.fixture
def tiny_folder(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


def test_folder_roundtrip_and_fingerprint_is_stable(tiny_folder: Path, tmp_path: Path) -> None:
    first = resolve_model(str(tiny_folder), cache_dir=str(tmp_path / "cache"))
    second = resolve_model(str(tiny_folder), cache_dir=str(tmp_path / "cache"))
    assert first.path == tiny_folder
    assert first.fingerprint == second.fingerprint
    assert len(first.fingerprint) == 64
    assert (tiny_folder / ".kvchat_fingerprint.json").is_file()
    runner = ModelRunner(first, num_blocks=4, block_size=4, device="cpu", dtype="float32")
    assert runner.fingerprint == first.fingerprint
    assert runner.forward([BatchItem([1, 2, 3], 0, [2], True)]).shape == (1, TINY["vocab_size"])


def test_fingerprint_changes_when_weights_change(tiny_folder: Path) -> None:
    before = fingerprint(tiny_folder)
    weights = tiny_folder / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1.0
    time.sleep(0.01)
    save_file(tensors, weights, metadata={"format": "pt"})
    assert fingerprint(tiny_folder) != before


def test_stale_fingerprint_cache_is_not_trusted(tiny_folder: Path) -> None:
    real = fingerprint(tiny_folder)
    cache = tiny_folder / ".kvchat_fingerprint.json"
    data = json.loads(cache.read_text())
    data["fingerprint"] = "0" * 64
    data["files"]["model.safetensors"][0] += 1  # a different size: the entry no longer describes the file
    cache.write_text(json.dumps(data))
    assert fingerprint(tiny_folder) == real


def test_nonexistent_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"model path .*nope.* does not exist"):
        resolve_model(str(tmp_path / "nope"), cache_dir=str(tmp_path))


def test_corrupt_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError, match=r"x\.gguf"):
        resolve_model(str(bad), cache_dir=str(tmp_path / "cache"))


def test_truncated_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "t.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\x05\x00")  # valid magic + version, then nothing
    with pytest.raises(ModelLoadError, match=r"t\.gguf"):
        resolve_model(str(bad), cache_dir=str(tmp_path / "cache"))
    assert not any((tmp_path / "cache" / "models").iterdir())  # no half-written cache left behind


def test_locate_model_checks_a_model_without_converting_it(tiny_folder: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    folder = locate_model(str(tiny_folder), cache_dir=str(cache))
    assert (folder.path, folder.is_gguf, folder.needs_conversion) == (tiny_folder, False, False)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(64))  # a header: converting it would fail
    source = locate_model(str(gguf), cache_dir=str(cache))
    assert (source.path, source.is_gguf, source.needs_conversion) == (gguf, True, True)
    assert not cache.exists()  # nothing was converted, nor a folder made
    (cache / "models" / gguf_cache_key(gguf)).mkdir(parents=True)
    (cache / "models" / gguf_cache_key(gguf) / "config.json").write_text("{}")
    assert not locate_model(str(gguf), cache_dir=str(cache)).needs_conversion  # converted by an earlier start


def test_a_gguf_converts_once_with_a_line_per_step_and_no_progress_bar(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    gguf = build_tiny_gguf(tmp_path / "tiny.gguf")
    capfd.readouterr()
    with caplog.at_level("INFO", logger="engine.model.loader"):
        resolved = resolve_model(str(gguf), cache_dir=str(tmp_path / "cache"))
    written = capfd.readouterr()
    assert (written.out, written.err) == ("", "")  # transformers' GGUF reader draws a tqdm bar unless it is wrapped
    steps = [r.getMessage() for r in caplog.records if r.getMessage()[:2] in ("1/", "2/", "3/", "4/")]
    assert steps == [
        "1/4 reading the GGUF's config",
        "2/4 dequantizing the weights to float32 (the long step)",
        "3/4 reading the tokenizer",
        "4/4 writing safetensors",
    ]
    assert resolved.path == tmp_path / "cache" / "models" / gguf_cache_key(gguf)
    assert not locate_model(str(gguf), cache_dir=str(tmp_path / "cache")).needs_conversion


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"PK\x03\x04", r"^'x\.gguf' is not a GGUF file \(bad magic b'PK\\x03\\x04'\) nor a model folder$"),
        (b"GG", r"^'x\.gguf' is not a GGUF file \(bad magic b'GG'\) nor a model folder$"),
    ],
)
def test_locate_model_refuses_what_is_not_a_gguf(tmp_path: Path, content: bytes, message: str) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(content)
    with pytest.raises(ModelLoadError, match=message):
        locate_model(str(bad), cache_dir=str(tmp_path / "cache"))


def test_truncated_safetensors(tiny_folder: Path, tmp_path: Path) -> None:
    weights = tiny_folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        resolve_model(str(tiny_folder), cache_dir=str(tmp_path / "cache"))


def test_unsupported_architecture(tiny_folder: Path, tmp_path: Path) -> None:
    config_file = tiny_folder / "config.json"
    config = json.loads(config_file.read_text())
    config["model_type"] = "gpt2"
    config["architectures"] = ["GPT2LMHeadModel"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"unsupported model architecture.*gpt2"):
        resolve_model(str(tiny_folder), cache_dir=str(tmp_path / "cache"))


def test_unknown_architectures_entry_is_rejected() -> None:
    with pytest.raises(ModelLoadError, match=r"unsupported model architecture \['LlamaForSequenceClassification'\]"):
        ModelSpec.from_hf_config({**TINY, "model_type": "llama", "architectures": ["LlamaForSequenceClassification"]})


def test_unsupported_rope_type() -> None:
    with pytest.raises(ModelLoadError, match=r"unsupported rope_type 'yarn'"):
        ModelSpec.from_hf_config({**TINY, "model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})


def test_mistral_sliding_window_caps_context() -> None:
    spec = ModelSpec.from_hf_config(
        {**TINY, "model_type": "mistral", "max_position_embeddings": 32768, "sliding_window": 4096}
    )
    assert spec.max_model_len == 4096


def test_folder_without_weights(tiny_folder: Path, tmp_path: Path) -> None:
    (tiny_folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        resolve_model(str(tiny_folder), cache_dir=str(tmp_path / "cache"))


@pytest.fixture(scope="session")
def smollm2_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    return os.environ.get("KVCHAT_CACHE_DIR") or str(tmp_path_factory.mktemp("kvchat_cache"))


@pytest.mark.slow
def test_smollm2_converts_once_and_matches_hf(smollm2_cache: str) -> None:
    first = resolve_model(DEFAULT_MODEL, cache_dir=smollm2_cache)
    assert not locate_model(DEFAULT_MODEL, cache_dir=smollm2_cache).needs_conversion
    written = {p.name: p.stat().st_mtime_ns for p in first.path.iterdir()}
    second = resolve_model(DEFAULT_MODEL, cache_dir=smollm2_cache)
    assert second == first
    assert {p.name: p.stat().st_mtime_ns for p in first.path.iterdir()} == written  # read again, not converted again
    assert (first.path / "tokenizer.json").is_file()

    runner = ModelRunner(first, num_blocks=16, block_size=16, device="cpu", dtype="float32")
    # in fp32 on a CPU with AVX2 (AVX-512 too) every linear weight is held as panels
    fp32_panels = kernels.library("panel_linear") is not None
    assert runner.model.weights.num_panels == (4 * 30 + 1 if fp32_panels else 0)
    # in bf16 where the AVX512-BF16 kernel runs every linear weight is held as pair panels
    bf16 = ModelRunner(first, num_blocks=16, block_size=16, device="cpu", dtype="bfloat16").model.weights
    pair_panels = kernels.library("bf16_panels") is not None
    assert bf16.num_panels == (4 * 30 + 1 if pair_panels else 0)
    assert runner.vocab_size == 49152
    assert runner.eos_token_ids == (2,)
    ids = [1, 31530, 28, 957, 1462, 314, 216, 34, 2]  # any short prompt
    hf = AutoModelForCausalLM.from_pretrained(first.path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    prefill = runner.forward([BatchItem(ids[:-1], 0, [7, 3], True)])
    decode = runner.forward([BatchItem(ids[-1:], len(ids) - 1, [7, 3], True)])
    assert (prefill[0] - ref[-2]).abs().max().item() <= 1e-4
    assert (decode[0] - ref[-1]).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_smollm2_fp32_rows_give_the_same_logits_alone_and_in_a_batch(smollm2_cache: str) -> None:
    # the default load: whichever kernels hold the weights, a decode row and a
    # one-row recompute (a fully cached prompt) must not depend on the batch around them, or a prefix-cache hit or a
    # busy server would change outputs
    runner = ModelRunner(resolve_model(DEFAULT_MODEL, cache_dir=smollm2_cache), 32, 16, device="cpu", dtype="float32")
    prompts = [[1, 31530, 28, 957, 1462, 314, 216, 34], [1, 11, 12, 13, 14, 15], [1, 99, 98, 97, 96, 95, 94]]
    tables = [[0, 1], [2, 3], [4, 5]]
    runner.forward([BatchItem(p, 0, t, False) for p, t in zip(prompts, tables, strict=True)])
    steps = [BatchItem([42], len(p), t, True) for p, t in zip(prompts, tables, strict=True)]
    together = runner.forward(steps)
    for i, step in enumerate(steps):
        assert torch.equal(runner.forward([step])[0], together[i])
    pair = runner.forward(steps[:2])
    assert torch.equal(pair, together[:2])
    # a fully cached prompt recomputes its last token alone: where the prefill kernel runs, the same bits as cold
    prompt, table = [(i * 7919) % 49000 + 10 for i in range(300)], list(range(6, 26))
    cold = runner.forward([BatchItem(prompt, 0, table, True)])[0]
    tail = runner.forward([BatchItem(prompt[-40:], 260, table, True)])[0]
    hit = runner.forward([BatchItem(prompt[-1:], 299, table, True, prompt=True)])[0]
    q = torch.zeros(1, runner.spec.num_heads, runner.spec.head_dim)
    pool = runner.kv_pool[0, 0]
    if prefill_attention.supports(q, q, pool, pool):
        assert torch.equal(tail, cold) and torch.equal(hit, cold)
    assert (hit - cold).abs().max().item() < 1e-3


def test_a_long_step_logs_its_progress(caplog: pytest.LogCaptureFixture) -> None:
    from engine.model.loader import _heartbeat

    with caplog.at_level("INFO", logger="engine.model.loader"), _heartbeat("still converting x.gguf", every_s=0.05):
        time.sleep(0.3)
    beats = [r.getMessage() for r in caplog.records if r.getMessage().startswith("still converting x.gguf… ")]
    assert len(beats) >= 2
    assert all(m.endswith("s") for m in beats)
