"""vLLM's ``suffix`` speculative method as a benchmark peer: the configuration reaches the worker (unit part, no
vLLM needed), and with the peers' venv installed, both vLLM peers reply on SmolLM2-135M (vLLM's CPU attention has
no kernel for the tiny test model's 16-wide heads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import run, suffix_decoding
from bench.runners import SYSTEMS, VENV_PEERS
from bench.runners.vllm import VENV, vllm_runner
from bench.suffix_peers import PeerSet, peer_sampling


def test_the_suffix_peer_starts_vllm_with_the_suffix_speculative_config(tmp_path: Path) -> None:
    plain = vllm_runner(tmp_path, 2, "bfloat16", None)
    suffix = vllm_runner(tmp_path, 2, "bfloat16", None, name="vllm-suffix")
    assert "speculative_config" not in plain.start_args
    assert suffix.start_args["speculative_config"] == {"method": "suffix"}
    assert (plain.name, suffix.name) == ("vllm", "vllm-suffix")
    assert {"vllm", "vllm-suffix"} <= set(SYSTEMS) & set(VENV_PEERS)  # bench.run takes it by name


def test_a_peer_stops_at_eos_with_the_replays_reply_settings() -> None:
    scoped_all = peer_sampling(suffix_decoding.REPLY_SETTINGS["repetition-1.2-all"])
    assert scoped_all == {"ignore_eos": False, "temperature": 0.0, "repetition_penalty": 1.2}
    assert peer_sampling(suffix_decoding.REPLY_SETTINGS["greedy"]) == {"ignore_eos": False, "temperature": 0.0}


def test_a_repetition_penalty_on_the_reply_only_is_refused_for_vllm_peers() -> None:
    with pytest.raises(ValueError, match=r"^vLLM cannot scope its repetition penalty to 'reply': it always covers"):
        peer_sampling(suffix_decoding.REPLY_SETTINGS["repetition-1.2-reply"])
    with pytest.raises(ValueError, match=r"^vLLM cannot scope"):  # the chat's defaults scope it to the reply
        peer_sampling(suffix_decoding.REPLY_SETTINGS["chat"])
    assert peer_sampling({"repetition_penalty": 1.2, "repetition_penalty_scope": "all"}) == {
        "ignore_eos": False,
        "repetition_penalty": 1.2,
    }


def test_a_peer_that_is_not_installed_is_reported_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run, "VENVS", tmp_path)
    (tmp_path / "vllm-suffix.status.json").write_text(json.dumps({"ok": False, "error": "cmake: no Python.h"}))
    peers = PeerSet(["vllm", "vllm-suffix"], "smollm2", "float32", 512, tmp_path / "logs")
    try:
        assert peers.runners == {}
        assert "install.sh vllm" in peers.errors["vllm"]
        assert "no Python.h" in peers.errors["vllm-suffix"]
    finally:
        peers.close()


def test_an_unknown_peer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown peer"):
        PeerSet(["sglang"], "smollm2", "float32", 512, tmp_path)


def _installed(peer: str) -> bool:
    return VENV.exists() and bool(run.install_status(peer).get("ok"))


@pytest.mark.skipif(not _installed("vllm-suffix"), reason="needs bench/peers/install.sh vllm (with arctic-inference)")
def test_both_vllm_peers_reply_with_ids_and_the_suffix_peer_counts_its_drafts(tmp_path: Path) -> None:
    peers = PeerSet(["vllm", "vllm-suffix"], "smollm2", "float32", 512, tmp_path)
    try:
        assert peers.errors == {}, [(tmp_path / f"{n}.worker.log").read_text()[-2000:] for n in peers.errors]
        prompt = [28, 29, 30, 31, 32] * 20  # a repetitive prompt: the suffix tree has something to propose
        replies = {}
        for name in ("vllm", "vllm-suffix"):
            arrived: list[int] = []
            done = peers.turn(name, prompt, 24, peer_sampling({"temperature": 0.0}), arrived.append)
            assert sum(arrived) == len(done["token_ids"]) == done["output_tokens"] > 0
            replies[name] = done
        assert replies["vllm"]["spec"] == {}
        assert set(replies["vllm-suffix"]["spec"]) == {"drafts", "draft_tokens", "accepted_tokens"}
        assert replies["vllm-suffix"]["spec"]["draft_tokens"] > 0
    finally:
        peers.close()
