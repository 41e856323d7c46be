"""Sampler: greedy, filters, seeded reproducibility, distributions, min_tokens."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidSamplingParamsError
from engine.sampler import RowError, Sampler, SamplerState
from engine.sampling_params import RepetitionScope, SamplingParams

VOCAB = 64
EOS = 7


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(seed=0)


def random_logits(n: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def state(sampler: Sampler, **params: object) -> SamplerState:
    return sampler.new_state(SamplingParams(**params), eos_token_ids=(EOS,))  # type: ignore[arg-type]


def test_greedy_is_argmax(sampler: Sampler) -> None:
    logits = random_logits(8, seed=1)
    states = [state(sampler) for _ in range(8)]
    assert sampler.sample(logits, states) == logits.argmax(dim=-1).tolist()
    assert [s.num_generated for s in states] == [1] * 8


def test_greedy_rows_in_a_mixed_batch_are_argmax(sampler: Sampler) -> None:
    logits = random_logits(4, seed=2)
    states = [state(sampler), state(sampler, temperature=1.0), state(sampler), state(sampler, temperature=0.5, seed=3)]
    tokens = sampler.sample(logits, states)
    assert [tokens[0], tokens[2]] == [int(logits[0].argmax()), int(logits[2].argmax())]


@pytest.mark.parametrize("seed", range(5))
def test_top_k_1_is_greedy(sampler: Sampler, seed: int) -> None:
    logits = random_logits(6, seed=seed)
    states = [state(sampler, temperature=1.5, top_k=1) for _ in range(6)]
    assert sampler.sample(logits, states) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("seed", range(5))
def test_tiny_top_p_is_greedy(sampler: Sampler, seed: int) -> None:
    logits = random_logits(6, seed=seed)
    states = [state(sampler, temperature=2.0, top_p=1e-6) for _ in range(6)]
    assert sampler.sample(logits, states) == logits.argmax(dim=-1).tolist()


def run_seeded(sampler: Sampler, position: int, others: list[SamplingParams], steps: int = 30) -> list[int]:
    """Sample a seeded request for ``steps`` steps at row ``position`` among ``others``; its row's logits are fixed."""
    target = state(sampler, temperature=1.0, top_k=40, top_p=0.95, seed=1234)
    other_states = [sampler.new_state(p, eos_token_ids=(EOS,)) for p in others]
    out = []
    for step in range(steps):
        logits = random_logits(len(others) + 1, seed=1000 + step * 7 + len(others))
        logits[position] = random_logits(1, seed=step)[0]
        states = [*other_states[:position], target, *other_states[position:]]
        token = sampler.sample(logits, states)[position]
        assert isinstance(token, int)
        out.append(token)
    return out


def test_seeded_request_ignores_batch_composition_and_position() -> None:
    alone = run_seeded(Sampler(seed=0), 0, [])
    noisy = [SamplingParams(temperature=1.0), SamplingParams(), SamplingParams(temperature=0.7, seed=5, top_k=3)]
    assert run_seeded(Sampler(seed=1), 2, noisy) == alone
    assert run_seeded(Sampler(seed=2), 0, noisy[:2]) == alone
    assert run_seeded(Sampler(seed=3), 3, noisy) == alone
    assert len(set(alone)) > 5  # it really sampled


def test_different_seeds_give_different_tokens(sampler: Sampler) -> None:
    logits = torch.zeros(1, VOCAB)
    runs = []
    for seed in (1, 2):
        s = state(sampler, temperature=1.0, seed=seed)
        runs.append([sampler.sample(logits, [s])[0] for _ in range(20)])
    assert runs[0] != runs[1]


def frequencies(sampler: Sampler, logits: torch.Tensor, draws: int, **params: object) -> torch.Tensor:
    s = state(sampler, seed=42, **params)
    counts = torch.zeros(logits.shape[-1])
    for _ in range(draws):
        [token] = sampler.sample(logits[None], [s])
        assert isinstance(token, int)
        counts[token] += 1
    return counts / draws


def test_temperature_frequencies_match_softmax(sampler: Sampler) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    freq = frequencies(sampler, logits, 8000, temperature=0.8)
    expected = torch.softmax(logits / 0.8, dim=-1)
    assert torch.allclose(freq, expected, atol=0.02), (freq, expected)


def test_top_k_renormalises_over_the_k_best(sampler: Sampler) -> None:
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0, 1.5])
    freq = frequencies(sampler, logits, 6000, temperature=1.0, top_k=2)
    expected = torch.zeros(5)
    expected[[1, 4]] = torch.softmax(torch.tensor([2.0, 1.5]), dim=-1)
    assert torch.allclose(freq, expected, atol=0.025), (freq, expected)


def test_top_p_keeps_the_smallest_nucleus(sampler: Sampler) -> None:
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5, 0.3 | 0.15, 0.05 -> 0.8 >= 0.7 after two tokens
    freq = frequencies(sampler, probs.log(), 6000, temperature=1.0, top_p=0.7)
    assert freq[0] == 0
    assert freq[2] == 0
    assert freq[1] == pytest.approx(0.5 / 0.8, abs=0.025)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_masks_eos_and_stop_tokens(sampler: Sampler, temperature: float) -> None:
    logits = torch.full((1, VOCAB), -40.0)
    logits[0, EOS], logits[0, 9], logits[0, 3] = 20.0, 10.0, 0.0
    s = state(sampler, temperature=temperature, min_tokens=3, stop_token_ids=(9,), seed=0)
    tokens = [sampler.sample(logits, [s])[0] for _ in range(4)]
    assert tokens[:3] == [3, 3, 3]
    assert tokens[3] == EOS
    assert s.is_stop_token(EOS)
    assert s.is_stop_token(9)
    assert not s.is_stop_token(3)


def test_ignore_eos_does_not_mask_or_stop_on_eos(sampler: Sampler) -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 5.0
    s = state(sampler, min_tokens=2, ignore_eos=True)
    assert sampler.sample(logits, [s]) == [EOS]
    assert not s.is_stop_token(EOS)


def test_stop_token_ids_outside_the_vocab_are_ignored(sampler: Sampler) -> None:
    logits = random_logits(1, seed=5)
    logits[0, EOS] = -100.0
    s = state(sampler, min_tokens=1, stop_token_ids=(VOCAB + 10,))
    assert sampler.sample(logits, [s]) == [int(logits[0].argmax())]


def test_batch_shape_mismatch_is_rejected(sampler: Sampler) -> None:
    with pytest.raises(ValueError, match="expected logits"):
        sampler.sample(torch.zeros(2, VOCAB), [state(sampler)])


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_k": -1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"seed": -3},
        {"min_tokens": 10, "max_tokens": 5},
        {"max_tokens": 0},
    ],
)
def test_invalid_params_are_rejected(params: dict[str, object]) -> None:
    with pytest.raises(InvalidSamplingParamsError):
        SamplingParams(**params)  # type: ignore[arg-type]


@pytest.mark.parametrize("field", ["max_tokens", "top_k", "seed", "min_tokens"])
def test_bools_are_not_integers_for_sampling_params(field: str) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=f"{field} must be an integer"):
        SamplingParams(**{field: True})  # type: ignore[arg-type]


def test_seed_must_fit_a_64_bit_generator() -> None:
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    with pytest.raises(InvalidSamplingParamsError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
        SamplingParams(seed=2**64)


def test_a_tiny_temperature_is_greedy_not_nan() -> None:
    sampler = Sampler()
    logits = torch.tensor([[0.0, 3.0, 1.0, -2.0]])
    state = sampler.new_state(SamplingParams(temperature=1e-40), eos_token_ids=())
    assert state.params.greedy
    assert sampler.sample(logits, [state]) == [1]


# --- edge values: every accepted parameter samples a finite distribution; everything else is refused by name ---------

TINY = [1e-300, 5e-324, 1e-45, 1e-38]  # far below float32's range, its smallest subnormal, its smallest normal
FLOAT_MAX = 1.7976931348623157e308
INF, NAN = float("inf"), float("nan")
REFUSED = [
    ("temperature", NAN, r"^temperature must be in \[0, 100\], got nan$"),
    ("temperature", INF, r"^temperature must be in \[0, 100\], got inf$"),
    ("temperature", -INF, r"^temperature must be in \[0, 100\], got -inf$"),
    ("temperature", FLOAT_MAX, r"^temperature must be in \[0, 100\], got 1\.7976931348623157e\+308$"),
    ("temperature", True, r"^temperature must be in \[0, 100\], got True$"),
    ("temperature", "1", r"^temperature must be in \[0, 100\], got '1'$"),
    ("top_p", NAN, r"^top_p must be in \(0, 1\], got nan$"),
    ("top_p", INF, r"^top_p must be in \(0, 1\], got inf$"),
    ("top_p", FLOAT_MAX, r"^top_p must be in \(0, 1\], got 1\.7976931348623157e\+308$"),
    ("top_p", 0.0, r"^top_p must be in \(0, 1\], got 0\.0$"),
    ("top_p", -5e-324, r"^top_p must be in \(0, 1\], got -5e-324$"),
    ("top_p", False, r"^top_p must be in \(0, 1\], got False$"),
    ("top_k", 1.0, r"^top_k must be an integer >= 0 \(0 disables it\), got 1\.0$"),
]


@pytest.mark.parametrize(("name", "value", "message"), REFUSED, ids=[f"{n}={v!r}" for n, v, _ in REFUSED])
def test_non_finite_and_out_of_range_values_are_refused_by_name(name: str, value: object, message: str) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=message) as raised:
        SamplingParams(**{name: value})  # type: ignore[arg-type]
    assert raised.value.code == "invalid_sampling_params"


EDGE_PARAMS = [
    *({"temperature": 1.0, "top_p": p} for p in [*TINY, 1.0]),
    *({"temperature": t} for t in [*TINY, 1e-5, 1.0, 100.0]),
    *({"temperature": 100.0, "top_p": p, "top_k": k} for p in TINY for k in (0, 1, 3)),
    {"temperature": 1e-5, "top_k": 1_000_000},
    {"temperature": 1.0, "top_k": 1, "top_p": 1e-300, "min_tokens": 1},
]
EDGE_LOGITS = {
    "normal": [2.0, 1.0, 0.5, 0.0, -1.0, -3.0],
    "near-float32-max": [3.0e38, -3.0e38, 1.0e38, 0.0, 3.4e38, -1.0],
    "masked": [-INF, 4.0, -INF, -INF, 3.9, -INF],
    "ties": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
}


@pytest.mark.parametrize("logits", EDGE_LOGITS.values(), ids=EDGE_LOGITS.keys())
@pytest.mark.parametrize("params", EDGE_PARAMS, ids=lambda p: ",".join(f"{k}={v!r}" for k, v in p.items()))
def test_every_accepted_edge_value_samples_a_valid_token(logits: list[float], params: dict[str, object]) -> None:
    sampler = Sampler(seed=0)
    row = torch.tensor([logits])
    finite = {i for i, x in enumerate(logits) if x != -INF}
    s = sampler.new_state(SamplingParams(**params, seed=1), eos_token_ids=(EOS,))  # type: ignore[arg-type]
    for _ in range(5):
        [token] = sampler.sample(row, [s])
        assert isinstance(token, int)
        assert token in finite


@pytest.mark.parametrize("p", TINY)
def test_a_top_p_below_float32_range_keeps_exactly_the_top_token(sampler: Sampler, p: float) -> None:
    # This top_p made the whole batch fail before (issue 20): it compared as 0.0 and filtered out every token.
    logits = random_logits(6, seed=11)
    states = [state(sampler, temperature=1.0, top_p=p) for _ in range(6)]
    assert sampler.sample(logits, states) == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("temperature", [1e-5, 2e-5, 1e-3])
def test_small_temperatures_on_huge_logits_pick_the_top_token(sampler: Sampler, temperature: float) -> None:
    logits = torch.tensor([[3.0e38, -3.0e38, 3.4e38, 1.0]])  # row / 1e-5 overflowed to inf before the shift
    assert sampler.sample(logits, [state(sampler, temperature=temperature, seed=3)]) == [2]


def test_min_tokens_that_would_mask_every_token_is_skipped_not_nan(sampler: Sampler) -> None:
    s = state(sampler, temperature=1.0, seed=0, min_tokens=2, stop_token_ids=tuple(range(VOCAB)))
    logits = random_logits(1, seed=4)
    [token] = sampler.sample(logits, [s])
    assert isinstance(token, int)
    assert 0 <= token < VOCAB


# --- row isolation: a row that cannot be sampled fails alone ------------------------------------------------------

BAD_ROWS = {
    "nan": float("nan"),
    "plus-inf": float("inf"),
}


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("poison", BAD_ROWS.values(), ids=BAD_ROWS.keys())
def test_a_non_finite_row_fails_alone(greedy: bool, poison: float) -> None:
    logits = random_logits(4, seed=8)
    params = {} if greedy else {"temperature": 0.8, "seed": 5}
    clean = Sampler(seed=0).sample(logits, [state(Sampler(), **params) for _ in range(4)])
    logits[2, 17] = poison
    sampler = Sampler(seed=0)
    outcomes = sampler.sample(logits, [state(sampler, **params) for _ in range(4)])
    assert outcomes[2] == RowError("the model produced non-finite logits")
    assert outcomes[:2] + outcomes[3:] == clean[:2] + clean[3:]


def test_a_row_with_no_finite_logit_fails_alone(sampler: Sampler) -> None:
    logits = random_logits(3, seed=9)
    logits[0] = float("-inf")
    outcomes = sampler.sample(logits, [state(sampler) for _ in range(3)])
    assert outcomes == [RowError("the model produced non-finite logits"), *logits[1:].argmax(dim=-1).tolist()]


def test_a_row_whose_sampling_raises_fails_alone_and_the_others_keep_their_seeded_draws() -> None:
    logits = random_logits(3, seed=10)
    params = {"temperature": 1.0, "seed": 77}
    clean = Sampler().sample(logits, [state(Sampler(), **params) for _ in range(3)])
    sampler = Sampler()
    states = [state(sampler, **params) for _ in range(3)]
    for i, s in enumerate(states):
        s.request_id = f"r{i}"

    def hook(s: SamplerState) -> None:
        if s.request_id == "r1":
            raise RuntimeError("boom")

    sampler.fault_hook = hook
    outcomes = sampler.sample(logits, states)
    assert outcomes == [clean[0], RowError("sampling raised RuntimeError: boom"), clean[2]]


# --- penalties, bias, min_p, logprobs, grammar: per row, so neighbours never change a row -------------------------


def test_a_repetition_penalty_turns_greedy_away_from_a_prompt_token() -> None:
    sampler = Sampler(vocab_size=VOCAB)
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 3.0, 2.0
    plain = sampler.new_state(SamplingParams(), eos_token_ids=(EOS,), prompt_token_ids=[5])
    penalised = sampler.new_state(SamplingParams(repetition_penalty=2.0), eos_token_ids=(EOS,), prompt_token_ids=[5])
    assert sampler.sample(torch.cat([logits, logits]), [plain, penalised]) == [5, 6]


def test_a_repetition_penalty_on_the_reply_only_leaves_prompt_tokens_free_until_the_reply_uses_them() -> None:
    sampler = Sampler(vocab_size=VOCAB)
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 3.0, 2.0
    params = SamplingParams(repetition_penalty=2.0, repetition_penalty_scope=RepetitionScope.REPLY)
    s = sampler.new_state(params, eos_token_ids=(EOS,), prompt_token_ids=[5])
    # 5 (in the prompt) wins once; then the reply has said it: 3.0 / 2 < 2.0, and 6 wins until it is said too
    assert [sampler.sample(logits, [s])[0] for _ in range(3)] == [5, 6, 5]


def test_a_frequency_penalty_grows_with_each_repeat() -> None:
    sampler = Sampler(vocab_size=VOCAB)
    logits = torch.zeros(1, VOCAB)
    logits[0, 10], logits[0, 11] = 2.0, 1.0
    s = sampler.new_state(SamplingParams(frequency_penalty=0.6), eos_token_ids=(EOS,))
    # 10 wins until its count makes 2.0 - 0.6 * count drop below 1.0 (after two), then 11 until it is used once.
    assert [sampler.sample(logits, [s])[0] for _ in range(4)] == [10, 10, 11, 10]


def test_logit_bias_steers_greedy_and_is_checked_against_the_vocabulary() -> None:
    sampler = Sampler(vocab_size=VOCAB)
    logits = random_logits(1, seed=12)
    top = int(logits[0].argmax())
    s = sampler.new_state(SamplingParams(logit_bias=((top, -100.0), (40, 100.0))), eos_token_ids=(EOS,))
    assert sampler.sample(logits, [s]) == [40]
    with pytest.raises(InvalidSamplingParamsError, match=rf"^logit_bias token id {VOCAB} is outside the vocabulary"):
        sampler.new_state(SamplingParams(logit_bias=((VOCAB, 1.0),)), eos_token_ids=(EOS,))


def test_min_p_one_keeps_only_the_top_token(sampler: Sampler) -> None:
    logits = random_logits(4, seed=13)
    states = [state(sampler, temperature=1.0, min_p=1.0, seed=i) for i in range(4)]
    assert sampler.sample(logits, states) == logits.argmax(dim=-1).tolist()


def test_logprobs_are_the_raw_model_log_probabilities_with_the_top_k(sampler: Sampler) -> None:
    logits = random_logits(2, seed=14)
    s = state(sampler, logprobs=3, repetition_penalty=1.5)
    [_, token] = sampler.sample(logits, [state(sampler), s])
    [entry] = s.logprobs
    expected = torch.log_softmax(logits[1], dim=-1)
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(float(expected[token]), abs=0, rel=0)
    values, ids = torch.topk(expected, 3)
    assert entry.top == tuple(zip(ids.tolist(), values.tolist(), strict=True))


def test_structured_output_needs_a_grammar_compiler(sampler: Sampler) -> None:
    from engine.sampling_params import GrammarKind, StructuredOutput

    with pytest.raises(InvalidSamplingParamsError, match=r"^structured output is not available in this sampler$"):
        state(sampler, structured=StructuredOutput(GrammarKind.JSON_OBJECT))


PROCESSED: list[dict[str, object]] = [
    {"repetition_penalty": 1.4},
    {"repetition_penalty": 1.4, "repetition_penalty_scope": RepetitionScope.REPLY},
    {"frequency_penalty": 0.8, "presence_penalty": 0.5, "temperature": 0.9, "seed": 4},
    {"logit_bias": ((2, 5.0), (8, -5.0)), "min_p": 0.05, "temperature": 1.2, "seed": 6},
    {"logprobs": 2, "min_tokens": 3},
]


@pytest.mark.parametrize("params", PROCESSED, ids=str)
def test_a_processed_row_ignores_its_batch_neighbours(params: dict[str, object]) -> None:
    def run(position: int, neighbours: list[dict[str, object]]) -> list[int]:
        sampler = Sampler(seed=position, vocab_size=VOCAB)
        target = sampler.new_state(SamplingParams(**params), (EOS,), prompt_token_ids=[1, 2, 3])  # type: ignore[arg-type]
        others = [sampler.new_state(SamplingParams(**p), (EOS,), prompt_token_ids=[4]) for p in neighbours]  # type: ignore[arg-type]
        out = []
        for step in range(20):
            logits = random_logits(len(others) + 1, seed=500 + step * 3 + len(others))
            logits[position] = random_logits(1, seed=step)[0]
            states = [*others[:position], target, *others[position:]]
            token = sampler.sample(logits, states)[position]
            assert isinstance(token, int)
            out.append(token)
        return out

    alone = run(0, [])
    assert run(1, [{}, {"temperature": 1.0}]) == alone
    assert run(2, PROCESSED[:3]) == alone
