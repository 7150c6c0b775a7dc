"""`kvwatt replay TRACE`: replay agentic traces against an OpenAI-compatible server (docs/replay.md).

Exit status: 0 every request succeeded; 1 some failed after retries, or the server could not be reached;
2 bad input; 130/143 stopped by SIGINT/SIGTERM (records and summary written so far are complete).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import aiohttp

from exporter.config import (
    DEFAULT_SERVER_URL,
    ConfigError,
    check_writable,
    duration_arg,
    is_finite,
    parse_duration,
    redacted_url,
    url_problem,
)
from exporter.rules.limits import MAX_CONCURRENCY, MAX_CONTEXT_TOKENS, MAX_TOKEN_ID
from kvwatt_lab.replay.client import CompletionClient
from kvwatt_lab.replay.progress import show_progress
from kvwatt_lab.replay.records import RecordSink, summary_line, write_summary
from kvwatt_lab.replay.runner import Replay, ReplayOptions, playable_sessions
from kvwatt_lab.replay.tokens import DEFAULT_TOKEN_ID_RANGE, TokenSource
from kvwatt_lab.replay.traces import FORMATS, MAX_LENGTH_SCALE, load_sessions, scale_session, scale_tokens

_EXIT_BY_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="trace file: Applied Compute JSONL or kvwatt sessions JSONL")
    p.add_argument("--format", default="auto", choices=FORMATS, help="trace format (default: per line)")
    p.add_argument("--url", default=DEFAULT_SERVER_URL, help=f"server base URL (default {DEFAULT_SERVER_URL})")
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    loop = p.add_argument_group("load")
    loop.add_argument("--concurrency", type=int, metavar="N", help="closed loop: N sessions at once (default 1)")
    loop.add_argument("--rate", type=float, metavar="PER_SECOND", help="open loop: Poisson session arrivals/s")
    loop.add_argument("--duration", metavar="DURATION", help="start no turn after this (30s, 5m); sessions cycle")
    loop.add_argument("--max-sessions", type=int, metavar="N", help="at most N sessions (default: each once)")
    shape = p.add_argument_group("shape")
    shape.add_argument("--seed", type=int, default=0, metavar="N", help="content, order, arrivals (default 0)")
    shape.add_argument("--system-prompt-tokens", type=int, default=1024, metavar="N",
                       help="shared system prompt length (default 1024)")
    shape.add_argument("--length-scale", type=float, default=1.0, metavar="X", help="multiply every token length")
    shape.add_argument("--latency-scale", type=float, default=1.0, metavar="X", help="multiply every tool latency")
    shape.add_argument("--max-context", type=int, metavar="TOKENS",
                       help="end a session before a turn whose prompt + output exceeds TOKENS")
    shape.add_argument("--token-id-range", metavar="LOW:HIGH", default="%d:%d" % DEFAULT_TOKEN_ID_RANGE,
                       help="synthetic ids from LOW (inclusive) to HIGH (exclusive); default %(default)s")
    requests = p.add_argument_group("requests")
    requests.add_argument("--retries", type=int, default=2, metavar="N", help="retries of a transient failure")
    requests.add_argument("--retry-backoff", type=duration_arg(zero_ok=True), default=0.5, metavar="DURATION",
                          help="first retry wait, doubling (500ms, or seconds; default 0.5)")
    requests.add_argument("--request-timeout", type=duration_arg(), default=600.0, metavar="DURATION",
                          help="per-request timeout (10m, or seconds; default 600)")
    out = p.add_argument_group("output")
    out.add_argument("--records", metavar="FILE", help="one JSON line per turn, flushed as it ends")
    out.add_argument("--summary", metavar="FILE", help="the summary as JSON")
    out.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="live progress bar on stderr (default: when stderr is a terminal)")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _finite(value: float | None) -> bool:
    return value is not None and is_finite(value)


def _at_most(value: int | None, limit: int, flag: str) -> None:
    _check(value is None or value <= limit, f"{flag}: must be <= {limit} (the limit), got {value}")


def build_options(args: argparse.Namespace) -> ReplayOptions:
    _check_load(args)
    _check_shape(args)
    _check_requests(args)
    system_tokens = scale_tokens(args.system_prompt_tokens, args.length_scale)
    _check(system_tokens <= MAX_CONTEXT_TOKENS, f"--system-prompt-tokens: {args.system_prompt_tokens} x --length-scale "
           f"{args.length_scale:g} is {system_tokens} tokens, more than the limit of {MAX_CONTEXT_TOKENS}")
    return ReplayOptions(
        concurrency=None if args.rate is not None else (args.concurrency or 1),
        rate_sessions_per_second=args.rate, seed=args.seed, system_prompt_tokens=system_tokens,
        latency_scale=args.latency_scale, max_context_tokens=args.max_context,
        duration_seconds=parse_duration(args.duration, "--duration") if args.duration is not None else None,
        max_sessions=args.max_sessions, retries=args.retries, retry_backoff_seconds=args.retry_backoff)


def _check_load(args: argparse.Namespace) -> None:
    _check(not (args.rate is not None and args.concurrency is not None), "--rate and --concurrency: choose one")
    _check(args.concurrency is None or args.concurrency >= 1,
           f"--concurrency: must be >= 1, got {args.concurrency}")
    _at_most(args.concurrency, MAX_CONCURRENCY, "--concurrency")
    _check(args.rate is None or (_finite(args.rate) and args.rate > 0), f"--rate: must be > 0, got {args.rate}")
    _check(args.max_sessions is None or args.max_sessions >= 1,
           f"--max-sessions: must be >= 1, got {args.max_sessions}")


def _check_shape(args: argparse.Namespace) -> None:
    _check(_finite(args.length_scale) and args.length_scale > 0,
           f"--length-scale: must be > 0, got {args.length_scale}")
    _check(args.length_scale <= MAX_LENGTH_SCALE,
           f"--length-scale: must be <= {MAX_LENGTH_SCALE:.15g} (the limit), got {args.length_scale:g}")
    _check(_finite(args.latency_scale) and args.latency_scale >= 0,
           f"--latency-scale: must be >= 0, got {args.latency_scale}")
    _check(args.system_prompt_tokens >= 0,
           f"--system-prompt-tokens: must be >= 0, got {args.system_prompt_tokens}")
    _at_most(args.system_prompt_tokens, MAX_CONTEXT_TOKENS, "--system-prompt-tokens")
    _check(args.max_context is None or args.max_context >= 1, f"--max-context: must be >= 1, got {args.max_context}")
    _at_most(args.max_context, MAX_CONTEXT_TOKENS, "--max-context")


def _check_requests(args: argparse.Namespace) -> None:
    problem = url_problem(args.url, "expected http(s)://HOST:PORT")
    _check(problem is None, f"--url: {problem}, got {redacted_url(args.url)!r}")
    _check(args.retries >= 0, f"--retries: must be >= 0, got {args.retries}")
    _check(_finite(args.retry_backoff) and args.retry_backoff >= 0,
           f"--retry-backoff: must be >= 0, got {args.retry_backoff}")
    _check(_finite(args.request_timeout) and args.request_timeout > 0,
           f"--request-timeout: must be > 0, got {args.request_timeout}")


def parse_token_id_range(text: str) -> tuple[int, int]:
    low, sep, high = text.partition(":")
    try:
        low_id, high_id = int(low), int(high)
    except ValueError:
        raise ConfigError(f"--token-id-range: expected LOW:HIGH, got {text!r}") from None
    _check(bool(sep) and 0 <= low_id < high_id, f"--token-id-range: expected 0 <= LOW < HIGH, got {text!r}")
    _check(high_id <= MAX_TOKEN_ID + 1, f"--token-id-range: HIGH must be <= {MAX_TOKEN_ID + 1} (32-bit ids), "
                                        f"got {text!r}")
    return low_id, high_id


def main(args: argparse.Namespace) -> int:
    options = build_options(args)
    low_id, high_id = parse_token_id_range(args.token_id_range)
    sessions = [scale_session(s, args.length_scale) for s in load_sessions(args.trace, args.format)]
    playable_sessions(sessions, options)  # fail now, before any file or connection, if nothing fits
    if args.summary:
        check_writable(args.summary, "--summary")  # now, not after the whole replay
    try:
        sink = RecordSink(args.records)
    except OSError as e:
        raise ConfigError(f"--records: cannot write {args.records} ({e.strerror})") from None
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    tokens = TokenSource(options.seed, low_id, high_id)
    try:
        summary, exit_code = asyncio.run(_replay(args, options, sessions, sink, tokens, progress))
    except _Unreachable as e:
        print(f"kvwatt: error: {e}", file=sys.stderr)
        return 1
    finally:
        sink.close()
    summary.update(trace=args.trace, url=redacted_url(args.url), length_scale=args.length_scale,
                   latency_scale=args.latency_scale, system_prompt_tokens=options.system_prompt_tokens,
                   max_context_tokens=options.max_context_tokens)
    if args.summary:
        try:
            write_summary(args.summary, summary)
        except OSError as e:  # e.g. the disk filled up during the replay; the records are written
            raise ConfigError(f"--summary: cannot write {args.summary} ({e.strerror or e})") from None
    print(summary_line(summary), flush=True)
    return exit_code or (1 if summary["failed"] else 0)


class _Unreachable(Exception):
    pass


async def _replay(args, options, sessions, sink, tokens, progress: bool) -> tuple[dict, int]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        model = args.model or await _first_model(http, args.url)
        replay = Replay(sessions, options, CompletionClient(http, args.url, model, args.request_timeout), sink,
                        tokens, say=_say)
        received: list[int] = []
        _install_signal_handlers(replay, received)
        bar = asyncio.create_task(show_progress(replay)) if progress else None
        try:
            summary = await replay.run()
        finally:
            _remove_signal_handlers()
            if bar is not None:
                bar.cancel()
                await asyncio.gather(bar, return_exceptions=True)
    return summary, _EXIT_BY_SIGNAL.get(received[0], 0) if received else 0


def _say(message: str) -> None:
    print(f"kvwatt replay: {message}", file=sys.stderr, flush=True)


async def _first_model(http: aiohttp.ClientSession, base_url: str) -> str:
    """The first model the server lists. A server that cannot be reached is said to be unreachable (passing
    --model would not help); one that answers without a usable list is asked for --model."""
    url = base_url.rstrip("/") + "/v1/models"
    shown_url, status = redacted_url(url), None
    try:
        async with http.get(url, timeout=aiohttp.ClientTimeout(total=30)) as resp:
            status = resp.status
            body = await resp.json(content_type=None)
    except (aiohttp.ClientConnectionError, asyncio.TimeoutError, OSError) as e:
        raise _Unreachable(f"the server at {redacted_url(base_url)} is unreachable ({_reason(e)}); is it running, "
                           "and is --url right?") from None
    except (aiohttp.ClientError, ValueError) as e:
        answered = f"HTTP {status}, " if status is not None else ""
        raise _Unreachable(f"cannot list models at {shown_url} ({answered}{type(e).__name__}); pass --model") from None
    try:
        return body["data"][0]["id"]
    except (KeyError, IndexError, TypeError):
        raise _Unreachable(f"cannot list models at {shown_url} (HTTP {status}, no model in the answer); "
                           "pass --model") from None


def _reason(error: BaseException) -> str:
    """A connection failure in a few words, without the URL (its credentials are already redacted above)."""
    if isinstance(error, asyncio.TimeoutError):
        return "no answer within 30 s"
    cause = getattr(error, "os_error", None) or error
    return getattr(cause, "strerror", None) or type(error).__name__


def _install_signal_handlers(replay: Replay, received: list[int]) -> None:
    """The first SIGINT/SIGTERM stops the replay cleanly; a second one gets the default behaviour."""
    loop = asyncio.get_running_loop()

    def handle(sig: int) -> None:
        received.append(sig)
        _remove_signal_handlers()
        replay.request_stop(interrupt=True)

    for sig in _EXIT_BY_SIGNAL:
        loop.add_signal_handler(sig, handle, sig)


def _remove_signal_handlers() -> None:
    loop = asyncio.get_running_loop()
    for sig in _EXIT_BY_SIGNAL:
        loop.remove_signal_handler(sig)
