"""`kvwatt demo`: the real daemon, on loopback only, watching three demo engines that replay bundled captures of
real vLLM engines (exporter/demo/story.py): one without offloading, its offloading twin (the same engine with
vLLM's OffloadingConnector on a host tier) and its tiered twin (a CPU tier and a disk tier). GPU energy is
simulated (exporter/demo/gpus.py) and every screen says so. docs/demo.md."""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile

from exporter.config import Config, ConfigError, ServerConfig, listen_url, parse_listen
from exporter.demo import gpus, story
from exporter.demo.endpoint import Playback, start_engine
from exporter.derive.tier_energy import PRIMARY_TIER
from exporter.rules import optin
from exporter.runtime import logsetup
from exporter.runtime.sampler import Sampler
from exporter.runtime.service import CannotListen, serve
from exporter.sources.nvml import NvmlSource
from exporter.sources.rapl import RaplSource

log = logging.getLogger("kvwatt")
OFF, ON, TIERED = "demo-no-offload", "demo-offload", "demo-tiered"
GPU_OFF, GPU_ON = "GPU-00000000-kvwatt-demo-simulated-0", "GPU-00000000-kvwatt-demo-simulated-1"
GPU_TIERED = "GPU-00000000-kvwatt-demo-simulated-2"
WINDOWS_SECONDS = (30.0, 120.0)
MIN_LOAD_SECONDS = 10.0  # J/token after 10 s of load (30 s in a real deployment): the story is 150 s long
# the per-tier families (opt-in in a deployment): the tiered server's disk tier ("1:fs") on the demo's /metrics
TIER_FAMILIES = frozenset(n for n in optin.OPT_IN_FAMILIES if n.startswith("kvwatt_offload_tier_"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--web.listen-address", "--listen", dest="listen", default="127.0.0.1:8492", metavar="HOST:PORT",
                   help="where the demo's page and /metrics are served (default 127.0.0.1:8492; loopback only)")
    p.add_argument("--speed", default="1", metavar="X", help="play the story X times faster (default 1, up to 10)")


def notice(length_seconds: float) -> str:
    return (f"DEMO: the servers here replay {length_seconds:.0f}-second captures of a real vLLM engine (quiet, "
            "then KV pressure, then a stalled engine), demo-offload with KV offloading to a host tier on, demo-tiered "
            "with a CPU tier and a disk tier; all GPU "
            f"energy is simulated (one GPU per server, held to an H100's {gpus.POWER_LIMIT_WATTS:.0f} W power limit). "
            "To watch a real server: kvwatt run --server NAME=http://HOST:PORT.")


def config(listen: str, off_url: str, on_url: str, length_seconds: float, state_dir: str,
           tiered_url: str | None = None) -> Config:
    servers = (ServerConfig(OFF, off_url, gpus=(GPU_OFF,)),
               ServerConfig(ON, on_url, gpus=(GPU_ON,), pair_off_server=OFF))
    if tiered_url is not None:
        servers += (ServerConfig(TIERED, tiered_url, gpus=(GPU_TIERED,), pair_off_server=OFF,
                                 offload_tier_bytes={PRIMARY_TIER: story.TIERED_CPU_TIER_BYTES}),)
    return Config(servers=servers, listen=listen, interval_seconds=0.5, windows_seconds=WINDOWS_SECONDS,
                  state_dir=state_dir, powercap_root=state_dir + "/no-powercap", threshold_window_seconds=10.0,
                  min_load_seconds=MIN_LOAD_SECONDS, metrics_opt_in=TIER_FAMILIES,
                  idle_power_watts={GPU_OFF: gpus.IDLE_WATTS, GPU_ON: gpus.IDLE_WATTS, GPU_TIERED: gpus.IDLE_WATTS},
                  notice=notice(length_seconds))


def _speed(text: str) -> float:
    try:
        speed = float(text)
    except ValueError:
        speed = float("nan")
    if not 0.1 <= speed <= 10:
        raise ConfigError(f"--speed: expected a number from 0.1 to 10, got {text!r}")
    return speed


async def _run(listen: str, speed: float) -> None:
    playback = Playback(story.load(), story.load(story.OFFLOAD_STORY_FILE), speed,
                        tiered_frames=story.load(story.TIERED_STORY_FILE))
    off, off_url = await start_engine(lambda: playback.frame().text)
    on, on_url = await start_engine(lambda: playback.frame(offloading=True).text)
    tiered, tiered_url = await start_engine(lambda: playback.frame(tiered=True).text)
    nvml = gpus.SimulatedNvml([(GPU_OFF, lambda: playback.token_counts(False)),
                               (GPU_ON, lambda: playback.token_counts(True)),
                               (GPU_TIERED, lambda: playback.token_counts(False, tiered=True))],
                              cost_scale=1.0 / speed)  # faster play, the same power: held to its limit
    try:
        with tempfile.TemporaryDirectory(prefix="kvwatt-demo-") as state_dir:
            cfg = config(listen, off_url, on_url, playback.length_seconds / speed, state_dir, tiered_url)
            log.info("demo: replaying %.0f s captures of a real vLLM engine, without and with offloading (energy "
                     "simulated); open %s", playback.length_seconds / speed, listen_url(listen))
            sampler = Sampler(cfg, nvml=NvmlSource(module=nvml), rapl=RaplSource(cfg.powercap_root))
            await serve(cfg, sampler=sampler)
    finally:
        await off.cleanup()
        await on.cleanup()
        await tiered.cleanup()


def main(args: argparse.Namespace) -> int:
    listen = parse_listen(args.listen, "--web.listen-address")
    if listen.rsplit(":", 1)[0] not in ("127.0.0.1", "localhost", "::1", "[::1]"):
        raise ConfigError(f"--web.listen-address: the demo serves on loopback only, got {args.listen}")
    speed = _speed(args.speed)
    logsetup.setup("info", "logfmt")
    try:
        asyncio.run(_run(listen, speed))
    except CannotListen as e:
        log.error("cannot serve on %s: %s", listen, e)
        return 2
    return 0
