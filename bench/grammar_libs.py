"""Which grammar library kvchat masks with: llguidance, xgrammar and outlines-core on the model's own vocabulary.

For each library that is installed: the one-time set-up for the tokenizer (token table / vocabulary index), the time
to build a grammar from a JSON schema (fresh each time: what a request with a new schema pays), the time to compute
one token mask while walking a valid document token by token (what every decode step of a grammar row pays), and
the installed size of the library with the dependencies kvchat would not otherwise have. Reproduce the committed
figures (docs/benchmarks/grammar_libs.json; xgrammar and outlines-core are not kvchat dependencies):

    .venv/bin/pip install xgrammar==0.2.8 outlines-core==0.2.14
    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.grammar_libs

Each library gets the same schemas and documents, in JSON written with ``json.dumps``'s separators (the form kvchat's
grammars allow: ``engine/grammar.py``). Libraries that are not installed are reported under ``errors``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.reporting import REPO_ROOT, format_table, machine_info, reproduce_command, write_json

DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks" / "grammar_libs.json"
# NOTE: per library, the distributions it installs that kvchat does not already depend on (torch, numpy, pydantic
# and transformers it does); their sizes count against it.
EXTRA_DISTRIBUTIONS = {
    "llguidance": ["llguidance"],
    "xgrammar": ["xgrammar", "apache-tvm-ffi", "triton"],
    "outlines-core": ["outlines_core"],
}

ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z0-9]{6}$"},
        "status": {"enum": ["pending", "shipped", "delivered", "returned"]},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["order_id", "status", "items"],
    "additionalProperties": False,
}
TICKET = {
    "type": "object",
    "properties": {
        "category": {"enum": ["refund", "shipping", "account", "product", "other"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "summary": {"type": "string", "maxLength": 200},
        "order_id": {"type": "string"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "vip": {"type": "boolean"}, "orders": {"type": "integer"}},
            "required": ["name"],
            "additionalProperties": False,
        },
        "needs_human": {"type": "boolean"},
    },
    "required": ["category", "priority", "summary"],
    "additionalProperties": False,
}
CASES = {
    "order lookup": (
        ORDER,
        {"order_id": "AB12CD", "status": "shipped", "items": [{"sku": "jacket-blue-m", "qty": 1}]},
    ),
    "support ticket (5 optional fields)": (
        TICKET,
        {
            "category": "refund",
            "priority": 2,
            "summary": "The jacket arrived with a torn sleeve; the customer wants a refund.",
            "order_id": "AB12CD",
            "tags": ["damaged", "refund"],
            "customer": {"name": "Dana", "vip": False, "orders": 3},
            "needs_human": False,
        },
    ),
}


@dataclass(frozen=True, slots=True)
class CaseResult:
    schema: str
    build_ms: float  # median of fresh builds
    first_mask_us: float
    mask_us_median: float
    mask_us_p99: float
    mask_us_mean: float
    tokens: int
    accepted: bool  # the valid document walked through the masks and ended accepted


@dataclass(frozen=True, slots=True)
class LibraryResult:
    library: str
    version: str
    install_mb: float
    setup_s: float  # the tokenizer's token table / vocabulary, once per model
    cases: list[CaseResult]


class Backend:
    """One library behind a common shape: ``setup`` once, then ``build`` a matcher, ``mask`` and ``accept``."""

    name = ""

    def setup(self, hf: Any, eos: int) -> None:
        raise NotImplementedError

    def build(self, schema: dict[str, Any]) -> Any:
        raise NotImplementedError

    def mask(self, matcher: Any) -> None:
        raise NotImplementedError

    def accept(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError


class LLGuidance(Backend):
    name = "llguidance"

    def setup(self, hf: Any, eos: int) -> None:
        import llguidance.hf

        from engine.grammar import JSON_OPTIONS

        self._ll = llguidance
        self._options = JSON_OPTIONS
        self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=len(hf), eos_token=eos)

    def build(self, schema: dict[str, Any]) -> Any:
        grammar = self._ll.LLMatcher.grammar_from_json_schema(schema, defaults=self._options)
        return self._ll.LLMatcher(self._tokenizer, grammar, log_level=0)

    def mask(self, matcher: Any) -> None:
        matcher.compute_bitmask()

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.consume_token(token))


class XGrammar(Backend):
    name = "xgrammar"

    def setup(self, hf: Any, eos: int) -> None:
        import xgrammar

        self._xgr = xgrammar
        self._info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=len(hf), stop_token_ids=[eos])
        self._bitmask = xgrammar.allocate_token_bitmask(1, self._info.vocab_size)

    def build(self, schema: dict[str, Any]) -> Any:
        # NOTE: a compiler per build, so no cache hides the compile cost of a schema seen before.
        compiler = self._xgr.GrammarCompiler(self._info, cache_enabled=False)
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        return self._xgr.GrammarMatcher(compiled)

    def mask(self, matcher: Any) -> None:
        matcher.fill_next_token_bitmask(self._bitmask)

    def accept(self, matcher: Any, token: int) -> bool:
        return bool(matcher.accept_token(token))


class OutlinesCore(Backend):
    name = "outlines-core"

    def setup(self, hf: Any, eos: int) -> None:
        import outlines_core
        import torch

        self._oc = outlines_core
        decode = _byte_decoder()
        special = set(hf.all_special_ids)
        tokens: dict[bytes, list[int]] = {}
        for piece, token_id in hf.get_vocab().items():
            if token_id in special:
                continue
            raw = bytes(decode[c] for c in piece) if all(c in decode for c in piece) else piece.encode()
            tokens.setdefault(raw, []).append(token_id)
        self._vocabulary = outlines_core.Vocabulary(eos, tokens)
        self._mask = torch.zeros((len(hf) + 31) // 32, dtype=torch.int32)

    def build(self, schema: dict[str, Any]) -> Any:
        from outlines_core.json_schema import build_regex_from_schema

        regex = build_regex_from_schema(json.dumps(schema), whitespace_pattern=r"[ ]?")
        return self._oc.Guide(self._oc.Index(regex, self._vocabulary))

    def mask(self, matcher: Any) -> None:
        matcher.write_mask_into(self._mask.data_ptr(), self._mask.numel(), 4)

    def accept(self, matcher: Any, token: int) -> bool:
        try:
            matcher.advance(token)
        except ValueError:
            return False
        return True


BACKENDS: dict[str, Callable[[], Backend]] = {
    "llguidance": LLGuidance,
    "xgrammar": XGrammar,
    "outlines-core": OutlinesCore,
}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a byte-level BPE vocabulary, reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def install_mb(library: str) -> float:
    total = 0
    for name in EXTRA_DISTRIBUTIONS[library]:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for file in dist.files or []:
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                total += path.stat().st_size
    return total / 1e6


def measure(backend: Backend, hf: Any, eos: int, repeats: int) -> LibraryResult:
    started = time.perf_counter()
    backend.setup(hf, eos)
    setup_s = time.perf_counter() - started
    cases = []
    for name, (schema, document) in CASES.items():
        tokens = [*hf.encode(json.dumps(document), add_special_tokens=False), eos]
        builds: list[float] = []
        firsts: list[float] = []
        masks: list[float] = []
        accepted = True
        for _ in range(repeats):
            t0 = time.perf_counter()
            matcher = backend.build(schema)
            builds.append(time.perf_counter() - t0)
            for i, token in enumerate(tokens):
                t0 = time.perf_counter()
                backend.mask(matcher)
                elapsed = time.perf_counter() - t0
                (firsts if i == 0 else masks).append(elapsed)
                if i < len(tokens) - 1 and not backend.accept(matcher, token):  # (EOS is masked, not consumed)
                    accepted = False
                    break
        ordered = sorted(masks) or [0.0]
        cases.append(
            CaseResult(
                schema=name,
                build_ms=statistics.median(builds) * 1e3,
                first_mask_us=statistics.median(firsts) * 1e6,
                mask_us_median=statistics.median(ordered) * 1e6,
                mask_us_p99=ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e6,
                mask_us_mean=statistics.fmean(ordered) * 1e6,
                tokens=len(tokens),
                accepted=accepted,
            )
        )
    library = backend.name
    version = importlib.metadata.version(EXTRA_DISTRIBUTIONS[library][0])
    return LibraryResult(library, version, install_mb(library), setup_s, cases)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, a safetensors folder or a .gguf file")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--libraries", nargs="*", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)

    from engine.model.loader import resolve_model
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model(args.model).path)
    eos = tokenizer.eos_token_ids[0]
    results: list[LibraryResult] = []
    errors: dict[str, str] = {}
    for name in args.libraries:
        try:
            results.append(measure(BACKENDS[name](), tokenizer.hf, eos, args.repeats))
        except ImportError as exc:
            errors[name] = f"not installed: {exc}"
    rows = [
        [
            *(r.library, r.version, round(r.install_mb, 1), round(r.setup_s, 2), c.schema, round(c.build_ms, 2)),
            *(round(c.first_mask_us), round(c.mask_us_median, 1), round(c.mask_us_p99, 1), c.accepted),
        ]
        for r in results
        for c in r.cases
    ]
    headers = ["library", "version", "install MB", "setup s", "schema", "build ms"]
    print(format_table([*headers, "1st mask us", "mask us p50", "mask us p99", "valid doc ok"], rows))
    for name, why in errors.items():
        print(f"{name}: {why}")
    payload = {
        "name": "grammar_libs",
        "command": "flock /tmp/kvchat-bench.lock " + reproduce_command("bench.grammar_libs", list(argv or [])),
        "machine": machine_info() | {"pid_cpus": len(os.sched_getaffinity(0))},
        "model": args.model,
        "vocab_size": len(tokenizer.hf),
        "results": [asdict(r) for r in results],
        "errors": errors,
    }
    print(f"wrote {write_json(args.out, payload)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
