"""One streamed `/v1/completions` request with a token-id prompt, timed, and retried when the failure is transient.

vLLM 0.32 with ``return_token_ids: true`` streams ``choices[0].token_ids`` (the new ids) in every chunk and,
with ``stream_options.include_usage``, a last chunk carrying ``usage``. The SSE stream is split by hand because
the first chunk echoes the whole prompt's ids, longer than aiohttp's line limit for long contexts.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp

RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class RequestError(Exception):
    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    server_prompt_tokens: int | None = None
    server_output_tokens: int | None = None
    ttft_seconds: float | None = None
    latency_seconds: float = 0.0
    token_ids_returned: bool = False  # False: the server sent no ids (not vLLM); only counts are known


@dataclass
class Outcome:
    completion: Completion | None = None  # None: every attempt failed
    attempts: int = 0
    error: str | None = None  # the last failure, kept after a successful retry
    transient: bool = False  # the last failure was transient (connection, timeout, 5xx): the server may be down


def request_body(model: str, prompt_ids: list[int], output_tokens: int) -> dict:
    return {"model": model, "prompt": prompt_ids, "max_tokens": output_tokens, "min_tokens": output_tokens,
            "ignore_eos": True, "temperature": 0.0, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}


class CompletionClient:
    def __init__(self, http: aiohttp.ClientSession, base_url: str, model: str, timeout_seconds: float):
        self.http = http
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/v1/completions"
        self.model = model
        self.timeout = aiohttp.ClientTimeout(total=timeout_seconds)

    async def complete(self, prompt_ids: list[int], output_tokens: int) -> Completion:
        started = time.monotonic()
        result = Completion()
        try:
            async with self.http.post(self.url, json=request_body(self.model, prompt_ids, output_tokens),
                                      timeout=self.timeout) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:300].replace("\n", " ")
                    raise RequestError(f"HTTP {resp.status}: {text}", resp.status in RETRYABLE_STATUS)
                async for event in _sse_events(resp):
                    _apply_event(result, event, started)
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            raise RequestError(f"{type(e).__name__}: {e}".rstrip(": "), retryable=True) from None
        result.latency_seconds = time.monotonic() - started
        if result.server_output_tokens is None:
            result.server_output_tokens = len(result.token_ids) if result.token_ids_returned else None
        if result.server_output_tokens is None:
            raise RequestError("stream ended without usage or token ids", retryable=True)
        return result

    async def complete_with_retries(self, prompt_ids: list[int], output_tokens: int, retries: int,
                                    backoff_seconds: float, outcome: Outcome | None = None) -> Outcome:
        """Try up to 1 + ``retries`` times, sleeping backoff, 2*backoff, ... between transient failures.

        Pass ``outcome`` to see the attempts made so far if the call is cancelled."""
        outcome = outcome or Outcome()
        for attempt in range(retries + 1):
            outcome.attempts = attempt + 1
            try:
                outcome.completion = await self.complete(prompt_ids, output_tokens)
                return outcome  # after a retry, ``error`` keeps the last transient failure
            except RequestError as e:
                outcome.error = str(e)
                outcome.transient = e.retryable
                if not e.retryable or attempt == retries:
                    return outcome
            await asyncio.sleep(backoff_seconds * 2 ** attempt)
        return outcome


class SseSplitter:
    """Incremental Server-Sent Events parser: ``feed(bytes)`` returns the complete `data:` payloads so far."""

    def __init__(self):
        self._buffer = b""
        self.done = False  # saw `data: [DONE]`

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        payloads = []
        while not self.done and (end := _event_end(self._buffer)) is not None:
            raw, self._buffer = self._buffer[:end[0]], self._buffer[end[1]:]
            payloads += self._data(raw)
        return payloads

    def finish(self) -> list[str]:
        """Payloads of an unterminated last event (a server that closes without a blank line)."""
        raw, self._buffer = self._buffer, b""
        return [] if self.done else self._data(raw)

    def _data(self, raw: bytes) -> list[str]:
        payloads = []
        for line in raw.decode("utf-8", "replace").splitlines():
            if line.startswith("data:") and not self.done:
                payload = line[5:].strip()
                self.done = payload == "[DONE]"
                if not self.done:
                    payloads.append(payload)
        return payloads


async def _sse_events(resp: aiohttp.ClientResponse):
    """Yield each `data:` payload (parsed JSON) until `[DONE]`; a body that ends before it is an error."""
    splitter = SseSplitter()
    async for chunk in resp.content.iter_any():
        for payload in splitter.feed(chunk):
            yield _parse_payload(payload)
        if splitter.done:
            return
    for payload in splitter.finish():
        yield _parse_payload(payload)
    raise RequestError("stream ended before [DONE]", retryable=True)  # a cut-off response is not a short one


def _event_end(buffer: bytes) -> tuple[int, int] | None:
    ends = [(i, i + len(sep)) for sep in (b"\n\n", b"\r\n\r\n") if (i := buffer.find(sep)) >= 0]
    return min(ends) if ends else None


def _parse_payload(payload: str) -> dict:
    try:
        event = json.loads(payload)
    except json.JSONDecodeError:
        raise RequestError(f"bad stream chunk: {payload[:120]}", retryable=True) from None
    if isinstance(event, dict) and "error" in event:  # vLLM reports mid-stream failures this way
        raise RequestError(f"server error in stream: {str(event['error'])[:300]}", retryable=True)
    return event


def _apply_event(result: Completion, event: dict, started: float) -> None:
    for choice in event.get("choices") or []:
        ids = choice.get("token_ids")
        if ids is not None:
            result.token_ids_returned = True
            result.token_ids += ids
        if result.ttft_seconds is None and (ids or choice.get("text")):
            result.ttft_seconds = time.monotonic() - started
    usage = event.get("usage")
    if usage:
        result.server_prompt_tokens = usage.get("prompt_tokens")
        result.server_output_tokens = usage.get("completion_tokens")
