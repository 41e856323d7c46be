"""``RemoteEngine``: the ``EngineClient`` of engine replicas over HTTP/SSE (``kvchat engine-serve``, or vLLM), reached
through vllm-router or one replica directly (``KVCHAT_ENGINE_URL``; docs/scale-out.md).

- **Tokenizing stays here.** The backend loads the model's tokenizer from the same model (``KVCHAT_MODEL``) and sends
  token ids with their segment spans, so its context builder and prompt budget stay authoritative. At start every
  replica's model fingerprint must equal the local one (``EngineMismatch`` otherwise: the ids would mean other text).
- **Session affinity.** Every request carries ``X-Session-ID`` (the session, else the request id), the key of the
  router's ``consistent_hash`` policy: a session's turns land on the replica that holds its KV.
- **Failures.** Before the first token, a replica that refuses the connection, stays silent past ``timeout_s``,
  answers a 5xx or garbage is retried (``retries`` times, with backoff: long enough for the router's health check to
  drop a dead replica, so the retry lands on another one, as a cache miss). After the first token the stream cannot
  be replayed: ``EngineUnreachable`` (the chat layer's ``unavailable`` error frame). Nothing waits forever.
- **Cache control** (``remote_cache.py``) goes to every replica directly (``remote_control.py`` says why, and what
  a down replica means): those listed (``KVCHAT_ENGINE_REPLICAS``), else the workers vllm-router lists
  (``/list_workers``), read at start and again every ``REFRESH_S`` (``refresh_replicas``): a replica the router
  dropped is no longer called, and a new one is checked (same model) and added. Each change is one log line.
- **vLLM replicas** (no ``/kvchat/info``): generation works (the namespace goes out as ``cache_salt``); invalidate,
  release, erase, pin, temperature, footprint, cache settings and engine stats do not exist there. Each missing item
  is logged once at start and its calls do nothing there, so no call fails because of it; but the result of an
  operator's action (erase, flush, invalidate, pin) names each replica that did nothing (``replica_report.py``), and
  ``reset_prefix_caches`` offers the coarser erase vLLM has (its whole prefix cache, where its server exposes it).

``stats``, ``session_footprint``, ``pin_prefix``, ``unpin`` and ``cache_settings`` are one blocking round trip per
replica here (in memory for the in-process engine): ``control_blocks`` tells the backend to await them through
``backend/engine_client/control.py`` (a worker thread and a deadline), never to call them on the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from typing import Any, TypeVar

import httpx

from backend.engine_client.messages import (
    CompletionRequest,
    InfoAnswer,
    KvchatExtra,
    StreamOptions,
)
from backend.engine_client.protocol import TextTokenizer
from backend.engine_client.remote_cache import RemoteCacheControl
from backend.engine_client.remote_control import ReplicaSet
from backend.engine_client.remote_errors import EngineMismatch, EngineProtocolError, EngineUnreachable
from backend.engine_client.remote_stream import StreamReader, error_of_response
from backend.engine_client.values import (
    DEFAULT_SHARE,
    EngineBusy,
    EngineError,
    EngineInfo,
    EngineStopped,
    FairShare,
    FinishReason,
    GenerationEvent,
    Prompt,
    RequestFinished,
    SamplingParams,
    TokenizedPrompt,
)
from backend.engine_client.wire import WireError, decode
from engine.prompt_encoder import PromptEncoder, needs_tokenizing

log = logging.getLogger("kvchat.engine_client")
T = TypeVar("T")

SESSION_HEADER = "X-Session-ID"
VLLM_MISSING = ("invalidate", "release", "erase", "pin", "session temperature", "footprint", "cache settings", "stats")

REFRESH_S = 60.0  # how often the router's worker list is read again (when the replicas are the router's)


class _Retryable(Exception):
    """A failure that another try (before the first token) may not meet; ``error`` is what the caller gets."""

    def __init__(self, error: EngineError) -> None:
        super().__init__(str(error))
        self.error = error


class RemoteEngine(RemoteCacheControl):
    """``await start()`` (checks the replicas, loads the tokenizer), then use it as any ``EngineClient``."""

    control_blocks = True  # its control calls wait on the network (backend/engine_client/control.py)

    def __init__(
        self,
        url: str,
        replicas: Sequence[str] = (),
        *,
        model: str,
        cache_dir: str | None = None,
        secret: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        uds: str | None = None,
        alive: Callable[[], bool] | None = None,
    ) -> None:
        """``uds``: reach the one engine at ``url`` through this unix socket (``engine_process.py``); ``alive``: what
        ``is_running`` adds to "started" (the engine process's last health check)."""
        self.url = url.rstrip("/")
        self._uds, self._alive = uds, alive
        self.model = model
        self._cache_dir = cache_dir
        self._timeout_s, self._retries, self._backoff_s = timeout_s, retries, backoff_s
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        self._headers = headers
        self._listed = [u.rstrip("/") for u in replicas]
        self._replicas = ReplicaSet([], headers, min(timeout_s, 10.0), uds)  # (filled at start: _discover)
        self._kvchat: ReplicaSet | None = None  # the replicas that are kvchat engines (vLLM ones have no control)
        self._vllm: list[str] = []  # the replicas that are vLLM servers
        self._http: httpx.AsyncClient | None = None
        self._encoder: PromptEncoder | None = None
        self._info: EngineInfo | None = None
        self._live: set[str] = set()
        self._aborted: set[str] = set()
        self._background: set[asyncio.Task[None]] = set()
        self._fingerprint = ""  # the local model's (set at start): a replica added later must serve the same
        self._routed = False  # whether the replicas are the router's list (then it is read again: refresh_replicas)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> EngineInfo:
        """Ask every replica what it serves, load the tokenizer, refuse a replica of another model."""
        await asyncio.to_thread(self._connect)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        timeout = httpx.Timeout(self._timeout_s, connect=min(self._timeout_s, 3.0))
        transport = httpx.AsyncHTTPTransport(uds=self._uds, limits=limits) if self._uds else None
        self._http = httpx.AsyncClient(headers=self._headers, timeout=timeout, limits=limits, transport=transport)
        if self._routed:
            self._background.add(asyncio.create_task(self._refresh_every(REFRESH_S), name="kvchat-replica-refresh"))
        return self.info

    async def stop(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        self._replicas.close()
        if self._kvchat is not None:
            self._kvchat.close()

    def _connect(self) -> None:
        from engine.model.loader import resolve_model
        from engine.tokenizer import Tokenizer

        self._replicas.urls = self._listed or self._discover()
        answers, vllm = self._probe()
        resolved = resolve_model(self.model, self._cache_dir)
        self._fingerprint = resolved.fingerprint
        tokenizer = Tokenizer(resolved.path)
        infos = [self._checked(url, answer, resolved.fingerprint) for url, answer in answers.items()]
        for url, max_len in vllm.items():
            infos.append(_vllm_info(str(resolved.path), resolved.fingerprint, tokenizer.vocab_size, max_len))
            log.warning("the engine replica %s is vLLM: its model is not checked (vLLM reports no fingerprint)", url)
        if vllm:
            log.warning("vLLM replica(s) have no %s: those calls do nothing there", ", ".join(VLLM_MISSING))
        pool_tokens = min(i.num_blocks * i.block_size for i in infos)
        self._info = dataclasses.replace(infos[0], num_blocks=min(i.num_blocks for i in infos))
        self._encoder = PromptEncoder(tokenizer, self._info.vocab_size, self._info.max_model_len, pool_tokens)
        kvchat_urls = [u for u in self._replicas.urls if u in answers]
        self._vllm = [u for u in self._replicas.urls if u in vllm]
        self._kvchat = (
            ReplicaSet(kvchat_urls, self._headers, min(self._timeout_s, 10.0), self._uds) if kvchat_urls else None
        )

    def _discover(self) -> list[str]:
        """The replicas behind ``url``: vllm-router's worker list (``/list_workers``), else ``url`` itself."""
        try:
            answer = self._replicas.call(self.url, "GET", "/list_workers")
        except EngineError:
            return [self.url]  # (a replica: it has no such route)
        urls = self._worker_list(answer)
        self._routed = True
        log.info("vllm-router at %s routes to %d replica(s): %s", self.url, len(urls), ", ".join(urls))
        return urls

    def _router_workers(self) -> list[str]:
        return self._worker_list(self._replicas.call(self.url, "GET", "/list_workers"))

    def _worker_list(self, answer: Any) -> list[str]:
        urls = answer.get("urls") if isinstance(answer, dict) else None
        if not isinstance(urls, list) or not urls or not all(isinstance(u, str) for u in urls):
            raise EngineProtocolError(f"{self.url}/list_workers answered no worker list: set KVCHAT_ENGINE_REPLICAS")
        return sorted(u.rstrip("/") for u in urls)

    async def _refresh_every(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await asyncio.to_thread(self.refresh_replicas)
            except EngineError as exc:
                log.debug("reading the router's replica list failed (the last one is kept): %s", exc)

    def refresh_replicas(self) -> None:
        """Read the router's worker list again: drop the replicas it no longer lists, check and add new ones (a
        kvchat replica must serve the local model; a vLLM one is added as at start). One log line per change."""
        listed = self._router_workers()
        kvchat = [u for u in (self._kvchat.urls if self._kvchat else []) if u in listed]
        vllm = [u for u in self._vllm if u in listed]
        added = []
        for url in (u for u in listed if u not in self._replicas.urls):
            try:
                answer = self._replicas.call(url, "GET", "/kvchat/info")
                self._checked(url, answer, self._fingerprint)
                kvchat.append(url)
            except EngineProtocolError:
                try:
                    _vllm_max_len(url, self._replicas.call(url, "GET", "/v1/models"))
                except EngineError as exc:
                    log.warning("the router's new replica %s is not used: %s", url, exc)
                    continue
                vllm.append(url)
            except EngineError as exc:
                log.warning("the router's new replica %s is not used: %s", url, exc)
                continue
            added.append(url)
        removed = [u for u in self._replicas.urls if u not in listed]
        if not added and not removed:
            return
        self._replicas.urls = sorted(set(kvchat) | set(vllm))
        self._vllm = sorted(vllm)
        if self._kvchat is None:
            self._kvchat = ReplicaSet(sorted(kvchat), self._headers, min(self._timeout_s, 10.0)) if kvchat else None
        else:
            self._kvchat.urls = sorted(kvchat)
            self._kvchat.down &= set(kvchat)
        log.info(
            "the router's replicas changed: added %s; removed %s",
            ", ".join(added) or "none",
            ", ".join(removed) or "none",
        )

    def _probe(self) -> tuple[dict[str, Any], dict[str, int]]:
        """Each replica's ``/kvchat/info`` answer, and the vLLM ones (no such route) with their context length."""
        answers: dict[str, Any] = {}
        vllm: dict[str, int] = {}
        for url in self._replicas.urls:
            try:
                answers[url] = self._replicas.call(url, "GET", "/kvchat/info")
            except EngineProtocolError:
                models = self._replicas.call(url, "GET", "/v1/models")
                vllm[url] = _vllm_max_len(url, models)
        return answers, vllm

    def _checked(self, url: str, answer: Any, fingerprint: str) -> EngineInfo:
        try:
            info: EngineInfo = decode(InfoAnswer, answer).info
        except WireError as exc:
            raise EngineProtocolError(f"the engine replica {url} answered /kvchat/info oddly: {exc}") from None
        if info.fingerprint != fingerprint:
            raise EngineMismatch(
                f"the engine replica {url} serves another model ({info.model_path}, fingerprint "
                f"{info.fingerprint[:12]}) than KVCHAT_MODEL={self.model} here (fingerprint {fingerprint[:12]}): "
                "point both at the same model"
            )
        return info

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineStopped("the remote engine is not connected")
        return self._info

    @property
    def is_running(self) -> bool:
        return self._http is not None and (self._alive is None or self._alive())

    @property
    def tokenizer(self) -> TextTokenizer:
        return self._prompts.tokenizer

    # ------------------------------------------------------------------ prompts

    @property
    def _prompts(self) -> PromptEncoder:
        if self._encoder is None:
            raise EngineStopped("the remote engine is not connected")
        return self._encoder

    @property
    def prompt_limit(self) -> int:
        return self._prompts.limit

    def prompt_token_floor(self, texts: Iterable[str]) -> int:
        return self._prompts.token_floor(texts)

    def tokenize(self, prompt: Prompt) -> list[int]:
        return self.tokenize_prompt(prompt).token_ids

    def tokenize_prompt(self, prompt: Prompt) -> TokenizedPrompt:
        return self._prompts.encode(prompt)

    # ------------------------------------------------------------------ requests

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        namespace: str = "default",
        request_id: str | None = None,
        session: str | None = None,
        share: FairShare = DEFAULT_SHARE,
    ) -> AsyncGenerator[GenerationEvent, None]:
        """Stream the reply from whichever replica the router picks for ``session``; retried before its first token.

        ``share`` travels under ``kvchat`` (our engine server schedules by it; a vLLM replica ignores it); the
        backend's quotas (``backend/core/tenant_quota.py``) hold at the edge either way.
        """
        if self._http is None:
            raise EngineStopped("the remote engine is not running")
        rid, params = request_id or uuid.uuid4().hex, params or SamplingParams()
        tokenized = await asyncio.to_thread(self.tokenize_prompt, prompt) if needs_tokenizing(prompt) else None
        tokenized = tokenized or self.tokenize_prompt(prompt)
        self._prompts.check_fits(len(tokenized.token_ids), params.max_tokens)  # (as the engine would: no round trip)
        body = self._body(tokenized, params, namespace, session, share)
        headers = {SESSION_HEADER: session or rid}
        self._live.add(rid)
        try:
            for attempt in range(self._retries + 1):
                reader = StreamReader(rid, len(tokenized.token_ids))
                try:
                    async for event in self._attempt(body, headers, reader):
                        yield event
                    return
                except _Retryable as exc:
                    if reader.token_ids or reader.text or attempt == self._retries:
                        raise exc.error from None
                    log.warning("request %s: %s; trying again (%d of %d)", rid, exc, attempt + 1, self._retries)
                    await asyncio.sleep(self._backoff_s * 2**attempt)
        finally:
            self._live.discard(rid)
            self._aborted.discard(rid)

    def _body(
        self,
        prompt: TokenizedPrompt,
        params: SamplingParams,
        namespace: str,
        session: str | None,
        share: FairShare = DEFAULT_SHARE,
    ) -> dict[str, Any]:
        """OpenAI's fields (what a vLLM replica reads), and the exact request under ``kvchat`` (what ours reads)."""
        request = CompletionRequest(
            model=self.model,
            prompt=prompt.token_ids,
            stream=True,
            stream_options=StreamOptions(include_usage=True),
            return_token_ids=True,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            stop=list(params.stop) or None,
            cache_salt=namespace,
            kvchat=KvchatExtra(
                spans=prompt.spans,
                system_tokens=prompt.system_tokens,
                session=session,
                sampling=params,
                share=share if share != DEFAULT_SHARE else None,
            ),
        )
        return request.model_dump(mode="json", exclude_none=True)

    async def _attempt(
        self, body: dict[str, Any], headers: dict[str, str], reader: StreamReader
    ) -> AsyncIterator[GenerationEvent]:
        assert self._http is not None  # (checked by generate)
        where, began = f"the engine at {self.url}", False
        try:
            async with self._http.stream("POST", self.url + "/v1/completions", json=body, headers=headers) as response:
                if response.status_code >= 400:
                    raise _refusal(response.status_code, await response.aread(), where)
                if not response.headers.get("content-type", "").startswith("text/event-stream"):
                    raise WireError(f"a {response.headers.get('content-type') or 'typeless'} answer, not a stream")
                began = True
                async for line in response.aiter_lines():
                    if reader.request_id in self._aborted:
                        yield reader.finished(FinishReason.ABORTED)  # (leaving closes the stream: the server aborts)
                        return
                    event = reader.line(line)
                    if event is not None:
                        yield event
                    if isinstance(event, RequestFinished) or reader.done:
                        return
        except httpx.TimeoutException:
            raise _Retryable(EngineUnreachable(f"{where} sent nothing for {self._timeout_s:g} s")) from None
        except httpx.HTTPError as exc:
            what = "broke off the stream" if began else "cannot be reached"
            raise _Retryable(EngineUnreachable(f"{where} {what}: {exc or type(exc).__name__}")) from None
        except WireError as exc:
            raise _Retryable(
                EngineProtocolError(f"{where} answered something that is not an engine's: {exc}")
            ) from None
        raise _Retryable(EngineUnreachable(f"{where} closed the stream mid-reply"))

    def abort(self, request_id: str) -> None:
        """Stop streaming ``request_id``: its stream ends (``ABORTED``) at its next event, and closing the
        connection aborts it on the replica."""
        if request_id in self._live:
            self._aborted.add(request_id)


def _refusal(status: int, body: bytes, where: str) -> Exception:
    """An HTTP error answer: the engine's refusal as it is (busy, too long), or a failure another try may not meet."""
    error = error_of_response(status, body, where)
    if isinstance(error, EngineBusy) or status < 500:
        return error
    if isinstance(error, EngineProtocolError):  # (vllm-router's own text, e.g. when every worker is down)
        error = EngineUnreachable(str(error).replace("is not an engine's answer", "is an error"))
    return _Retryable(error)


def _vllm_max_len(url: str, models: Any) -> int:
    try:
        return int(models["data"][0]["max_model_len"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise EngineProtocolError(f"{url} is neither a kvchat engine nor a vLLM server (no model card)") from None


def _vllm_info(model_path: str, fingerprint: str, vocab_size: int, max_model_len: int) -> EngineInfo:
    block = 16  # NOTE: vLLM's default block size; only the prompt limit (max_model_len) derives from it here
    return EngineInfo(model_path, fingerprint, "vllm", "remote", "unknown", max_model_len // block, block, 0,
                      max_model_len, vocab_size)  # fmt: skip
