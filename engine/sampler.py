"""Logits -> next token, one per sequence in the batch.

``Sampler.sample(logits, states)`` takes float32 logits ``[n, vocab]`` and one ``SamplerState`` per row and returns
one outcome per row: the chosen token id, or a ``RowError`` when that row cannot be sampled (the model gave NaN or
+inf logits, its grammar allows nothing, or sampling it raised). A failed row never affects the others: the engine
fails that request alone. A state is made once per request with ``Sampler.new_state(params, eos_token_ids, ...)``
and lives as long as the request; the sampler records each token it picks in it (penalty counts, grammar position).

* A batch whose rows are all plain greedy (no penalty, bias, grammar, min-tokens mask or logprobs) costs a single
  argmax call.
* Every other row is processed alone, on a copy of its own 1-D row, in vLLM's order (``engine/logits_processors.py``):
  grammar mask, logit bias, min-tokens mask, penalties; then argmax when greedy, else temperature, min_p, top-k,
  top-p and one multinomial draw. Every parameter value ``SamplingParams`` accepts gives finite probabilities.
* Nothing a row does depends on another row: a reply is the same whatever its batch neighbours, and (fp32) whether
  its prompt came from the prefix cache or not.
* A request with a ``seed`` owns a ``torch.Generator`` seeded once at request start and advanced only by that
  request's draws, so its tokens do not depend on the batch it lands in or its row in it. Unseeded requests share
  the sampler's generator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from engine.errors import InvalidSamplingParamsError
from engine.grammar import GrammarCompiler, GrammarMatcher
from engine.logits_processors import (
    TokenHistory,
    apply_logit_bias,
    apply_penalties,
    logit_bias_tensors,
    mask_ids,
    min_p,
    scale_by_temperature,
    top_k,
    top_p,
)
from engine.model import cpu_kernels, kernels
from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplerState:
    """What the sampler keeps per request.

    ``stop_token_ids`` are the ids that end the request: the EOS ids (unless ``ignore_eos``) plus the request's own
    ``stop_token_ids``. While fewer than ``min_tokens`` tokens have been generated they are masked out.
    ``logprobs`` holds one entry per sampled token when the request asked for them.
    """

    params: SamplingParams
    stop_token_ids: frozenset[int]
    generator: torch.Generator | None  # None: unseeded, draws come from the sampler's shared generator
    num_generated: int = 0
    request_id: str = ""  # for logs and fault injection (engine.testing)
    history: TokenHistory | None = None  # with penalties
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # with logit_bias: (ids, values)
    grammar: GrammarMatcher | None = None  # with structured output
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def masks_stop_tokens(self) -> bool:
        return self.num_generated < self.params.min_tokens and bool(self.stop_token_ids)

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy with nothing to do to its row: the batch argmax is its token."""
        p = self.params
        return p.greedy and not p.changes_logits and p.logprobs is None and not self.masks_stop_tokens

    def is_stop_token(self, token_id: int) -> bool:
        """True when ``token_id`` ends the request (the engine checks this after each step)."""
        return token_id in self.stop_token_ids

    def record(self, token_id: int) -> None:
        """The token picked for this request: count it and advance its grammar."""
        if self.history is not None:
            self.history.record(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)


@dataclass(frozen=True, slots=True)
class RowError:
    """Why one row of the batch could not be sampled (the engine logs it and fails that request alone)."""

    reason: str


class _RowFailure(Exception):
    """A row that cannot be sampled for a reason the sampler names (not a bug)."""


SampleOutcome = int | RowError
FaultHook = Callable[[SamplerState], None]


class Sampler:
    """Turns a batch of logits into next tokens; stateless apart from the shared generator for unseeded requests.

    ``vocab_size`` (optional) checks ``logit_bias`` ids when a request starts; ``grammar`` compiles structured-output
    requests (without one they are refused). ``fault_hook`` (None in production) is called with each row's state
    before the row is sampled; an exception it raises fails that row alone (engine.testing injects failures so).
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        seed: int | None = None,
        vocab_size: int | None = None,
        grammar: GrammarCompiler | None = None,
    ) -> None:
        self.device = torch.device(device)
        self._generator = _make_generator(self.device, seed)
        self._vocab_size = vocab_size
        self._grammar = grammar
        self.fault_hook: FaultHook | None = None

    def new_state(
        self,
        params: SamplingParams,
        eos_token_ids: tuple[int, ...],
        request_id: str = "",
        prompt_token_ids: Sequence[int] = (),
    ) -> SamplerState:
        """Per-request state: its generator (``params.seed``), penalty history, bias and grammar matcher. Raises
        ``InvalidSamplingParamsError`` for a bias outside the vocabulary or a grammar that cannot be compiled."""
        eos = () if params.ignore_eos else eos_token_ids
        state = SamplerState(
            params=params,
            stop_token_ids=frozenset((*eos, *params.stop_token_ids)),
            generator=None if params.seed is None else _make_generator(self.device, params.seed),
            request_id=request_id,
        )
        if params.has_penalties:
            state.history = TokenHistory(prompt_token_ids, params.max_tokens)
        if params.logit_bias:
            outside = [t for t, _ in params.logit_bias if self._vocab_size is not None and t >= self._vocab_size]
            if outside:
                raise InvalidSamplingParamsError(
                    f"logit_bias token id {outside[0]} is outside the vocabulary [0, {self._vocab_size})"
                )
            state.bias = logit_bias_tensors(params.logit_bias, self.device)
        if params.structured is not None:
            if self._grammar is None:
                raise InvalidSamplingParamsError("structured output is not available in this sampler")
            state.grammar = self._grammar.compile(params.structured)
        return state

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, states: list[SamplerState]) -> list[SampleOutcome]:
        """Pick one token per row (or say why a row failed); counts the row in its state's ``num_generated`` and
        records the picked token in its state."""
        _check_batch(logits, states)
        logits = logits.to(self.device)
        failed = _non_finite_rows(logits) | self._hook_failures(states)
        if all(s.is_plain_greedy for s in states):
            tokens = _argmax(logits)  # NOTE: the fast path: one call, no copies.
        else:
            with _one_thread():
                tokens = self._sample_rows(logits, states, failed)
        for row, state in enumerate(states):
            state.num_generated += 1
            if row not in failed:
                state.record(tokens[row])
        return [failed.get(row, token) for row, token in enumerate(tokens)]

    @torch.inference_mode()
    def verify(self, logits: torch.Tensor, state: SamplerState, drafts: Sequence[int]) -> list[int] | RowError:
        """The tokens a request takes from one step that verified ``drafts`` after its last token: ``logits`` holds
        ``len(drafts) + 1`` rows (row i predicts the token after draft i - 1). Returns the accepted drafts and one
        more token (the model's own where the first draft failed, or after the last draft; none after a stop token),
        or why the rows cannot be sampled.

        The rows are taken in order, each exactly as decoding would take it with the drafts before it as the reply so
        far: its logits processed with the state as it stands (grammar mask, bias, min-tokens mask, penalties over
        the history that includes the accepted drafts), then the choice, which is recorded before the next row. Greedy:
        a draft is accepted when it is the processed row's argmax, so the tokens are the ones decoding without drafts
        picks, bit for bit (the rows' logits are: paged_attention.build_plan), and a draft the grammar forbids is
        never accepted. Sampled: standard speculative rejection sampling for a point-mass proposal: draft t is
        accepted with probability p(t) of the processed row; on a rejection the token is drawn from p with t removed
        (renormalised), which leaves every emitted token distributed as p. (The engine gives seeded requests no
        drafts: ``drafts_allowed``.)
        """
        if logits.dim() != 2 or logits.shape[0] != len(drafts) + 1:
            raise ValueError(f"expected logits [{len(drafts) + 1}, vocab], got {tuple(logits.shape)}")
        logits = logits.to(self.device)
        failure = _non_finite_rows(logits) or self._hook_failures([state])
        if failure:
            return next(iter(failure.values()))
        if state.is_plain_greedy:  # NOTE: the fast path: one argmax call over the rows
            picked = _argmax(logits)
            tokens = list(drafts[: _accepted_prefix(picked, drafts)])
            tokens.append(picked[len(tokens)])
            for token in tokens:
                state.num_generated += 1
                state.record(token)
            return tokens
        try:
            with _one_thread():
                return self._verify_rows(logits, state, drafts)
        except _RowFailure as exc:
            return RowError(str(exc))
        except Exception as exc:  # noqa: BLE001 - one bad row must not fail the batch
            return RowError(f"sampling raised {type(exc).__name__}: {exc}")

    def _verify_rows(self, logits: torch.Tensor, state: SamplerState, drafts: Sequence[int]) -> list[int]:
        generator = state.generator if state.generator is not None else self._generator
        tokens: list[int] = []
        for at in range(len(drafts) + 1):
            draft = drafts[at] if at < len(drafts) else None
            token, accepted = self._verify_row(logits[at], state, draft, generator)
            if state.params.logprobs is not None:
                state.logprobs.append(_token_logprob(logits[at], token, state.params.logprobs))
            tokens.append(token)
            state.num_generated += 1
            state.record(token)
            if not accepted or state.is_stop_token(token):
                break
        return tokens

    def _verify_row(
        self, raw: torch.Tensor, state: SamplerState, draft: int | None, generator: torch.Generator
    ) -> tuple[int, bool]:
        """One verified row: (its token, whether it is the draft)."""
        row = self._processed(raw, state)
        if state.params.greedy:
            token = _argmax(row[None])[0]
            return token, token == draft
        probs = _probs(row, state.params)
        if draft is not None:
            if float(torch.rand((), generator=generator, device=probs.device)) < float(probs[draft]):
                return draft, True
            probs[draft] = 0.0
        return int(torch.multinomial(probs, num_samples=1, generator=generator).item()), False

    def _sample_rows(self, logits: torch.Tensor, states: list[SamplerState], failed: dict[int, RowError]) -> list[int]:
        """The batch argmax for plain greedy rows, each other row alone; a row that fails is recorded in ``failed``."""
        tokens = _argmax(logits)
        for row, state in enumerate(states):
            if row in failed or state.is_plain_greedy:
                continue
            try:
                tokens[row] = self._choose(logits[row], state)
                if state.params.logprobs is not None:
                    state.logprobs.append(_token_logprob(logits[row], tokens[row], state.params.logprobs))
            except _RowFailure as exc:
                failed[row] = RowError(str(exc))
            except Exception as exc:  # noqa: BLE001 - one bad row must not fail the batch
                failed[row] = RowError(f"sampling raised {type(exc).__name__}: {exc}")
        return tokens

    def _choose(self, raw: torch.Tensor, state: SamplerState) -> int:
        """One row's token: its logits processed (on a copy), then argmax or one draw.

        NOTE: rows are processed one at a time, on a 1-D view, so a request's result depends only on its own logits,
        state and generator, never on the batch size or its position in the batch.
        """
        params = state.params
        row = self._processed(raw, state)
        if params.greedy:
            return _argmax(row[None])[0]
        generator = state.generator if state.generator is not None else self._generator
        return _draw(row, params, generator)

    def _processed(self, raw: torch.Tensor, state: SamplerState) -> torch.Tensor:
        """The row as the choice sees it: grammar mask, logit bias, min-tokens mask, penalties (on a copy, when any
        applies). Raises ``_RowFailure`` when nothing is left to choose."""
        params = state.params
        row = raw
        if params.changes_logits or state.masks_stop_tokens:
            row = raw.clone()
            if state.grammar is not None and not state.grammar.apply(row):
                raise _RowFailure("the grammar allows no token here")
            if state.bias is not None:
                apply_logit_bias(row, *state.bias)
            if state.masks_stop_tokens:
                # NOTE: when every token the model can emit is a stop token, min_tokens cannot be met: the mask is
                # skipped (the request stops) rather than leaving a row with nothing to sample.
                mask_ids(row, sorted(state.stop_token_ids))
            if state.history is not None:
                apply_penalties(row, state.history, params)
            if not bool(torch.isfinite(row.max())):
                raise _RowFailure("the sampling parameters left no finite logit")
        return row

    def _hook_failures(self, states: list[SamplerState]) -> dict[int, RowError]:
        if self.fault_hook is None:
            return {}
        failed: dict[int, RowError] = {}
        for row, state in enumerate(states):
            try:
                self.fault_hook(state)
            except Exception as exc:  # noqa: BLE001 - the hook stands for any failure inside one row
                failed[row] = RowError(f"sampling raised {type(exc).__name__}: {exc}")
        return failed


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one intra-op thread while rows are processed one by one.

    NOTE: a row is 50k logits: each op on it would open an OpenMP parallel region, and on busy cores every region
    waits for a descheduled worker. Measured on 2 contended cores (SmolLM2's vocabulary): a row's copy took 380 us
    with 2 threads and 4 us with 1; a step with one grammar row and one sampled row 45 ms against 3 ms. Setting the
    thread count costs under a microsecond; the forward pass gets its threads back before it runs.
    """
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _argmax(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first of equal values), with the C kernel on CPU where it is built."""
    _, lib = kernels.choose_with_library(kernels.Op.ARGMAX, logits.dtype, device=logits.device.type)
    if lib is not None and cpu_kernels.argmax_supported(logits):
        return cpu_kernels.argmax(lib, logits)
    tokens: list[int] = logits.argmax(dim=-1).tolist()
    return tokens


def _draw(row: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One draw from a processed row: temperature, min_p, top-k, top-p, multinomial."""
    return int(torch.multinomial(_probs(row, params), num_samples=1, generator=generator).item())


def _probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a processed row is drawn from: temperature, min_p, top-k, top-p, softmax."""
    scaled = scale_by_temperature(row, params.temperature)
    filtered = top_p(top_k(min_p(scaled, params.min_p), params.top_k), params.top_p)
    return torch.softmax(filtered, dim=-1)


def _accepted_prefix(picked: Sequence[int], drafts: Sequence[int]) -> int:
    """How many leading drafts equal the picked tokens of their rows."""
    n = 0
    while n < len(drafts) and picked[n] == drafts[n]:
        n += 1
    return n


def drafts_allowed(state: SamplerState, default: bool) -> bool:
    """Whether a request's next step may verify drafts: unless it asked for none (``SamplingParams.drafts``; None
    takes ``default``, the engine's switch), or it samples with a seed.

    NOTE: a seeded request's tokens must not depend on its batch (see the module docstring), and whether a step
    verifies drafts does (the cost model looks at the batch); verifying consumes other random draws than decoding.
    Grammar, penalties, bias, min-tokens masking and logprobs need nothing more: ``Sampler.verify`` takes the rows
    one by one with the state advanced by the drafts before each. Stop strings neither: the engine hands the
    accepted tokens over one by one and drops those after a stop.
    """
    p = state.params
    wanted = default if p.drafts is None else p.drafts
    return wanted and (p.greedy or p.seed is None)


def _token_logprob(raw: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """The model's own log-probabilities (vLLM's ``raw_logprobs``): the sampled token's and the ``k`` largest."""
    logprobs = torch.log_softmax(raw, dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k:
        values, ids = torch.topk(logprobs, k)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprob(token, float(logprobs[token]), top)


def _make_generator(device: torch.device, seed: int | None) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()  # non-deterministic seed from the OS
    else:
        generator.manual_seed(seed)
    return generator


def _check_batch(logits: torch.Tensor, states: list[SamplerState]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(states):
        raise ValueError(f"expected logits [n={len(states)}, vocab], got {tuple(logits.shape)}")


def _non_finite_rows(logits: torch.Tensor) -> dict[int, RowError]:
    """Rows with a NaN or +inf logit, or without any finite one: nothing sensible can be sampled from them.

    NOTE: one reduction over the batch: a row's max is NaN when it holds a NaN, +inf with a +inf, and -inf when no
    logit is finite; -inf entries (masked tokens) are fine as long as one logit is finite.
    """
    row_max = logits.amax(dim=-1)
    bad = (~torch.isfinite(row_max)).nonzero().flatten().tolist()
    return {row: RowError("the model produced non-finite logits") for row in bad}
