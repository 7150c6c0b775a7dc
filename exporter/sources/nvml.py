"""GPU energy through NVML (nvidia-ml-py, module ``pynvml``), each GPU isolated from the others.

Rules applied (docs/energy-measurement.md):
- rule 1: the total-energy counter (mJ since the driver loaded) differenced, never an averaged power.
- rule 2: a GPU without the counter gets ``NVML_FI_DEV_POWER_INSTANT`` sampled at >= 10 Hz by a background
  thread and integrated here (``nvmlDeviceGetPowerUsage`` is a 1 s trailing average: a gauge only).
- rule 6: every field value's ``nvmlReturn`` is checked and the union member ``valueType`` names is read.
- rules 3-5: lost / unknown / reset-required marks that GPU down (no sample, counter frozen, retried by UUID
  with back-off) while the others go on; a counter that went down is a reset (re-based, continuous=False).
- no NVML at all (module missing, library not found, driver not loaded): ``SourceStatus(up=False)`` with the
  reason, retried now and then; the daemon runs on.

GPUs are read concurrently. ``nvmlDeviceGetTotalEnergyConsumption`` costs ~3 ms median and up to 18 ms on
an H100 (ctypes releases the GIL during the call), so eight GPUs read one after another would take ~25 ms a
tick with tails past 50 ms. Each GPU's NVML calls run as one task in the source's thread pool; the state
(corrected totals, back-off, re-basing) is only touched by the thread calling ``read``, after the task
returned. A GPU whose task misses ``read``'s deadline gets no sample this tick (rule 3: a gap, never a
guess); it is not read again while that task still runs, and the task's result, when it comes, is thrown
away and the counter re-based, so no energy is invented or counted twice.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from exporter.samples import DeviceReading, SourceStatus

log = logging.getLogger("kvwatt.nvml")

SAMPLE_HZ = 20.0  # instant-power sampling for GPUs without the counter (rule 2: >= 10 Hz)
MAX_SAMPLE_GAP_SECONDS = 0.5  # a longer gap between power samples breaks the integral (no guessing)
MAX_PLAUSIBLE_WATTS = 3000.0  # above any board today (GB200 superchip ~2.7 kW): a larger step is a glitch
RETRY_INITIAL_SECONDS = 1.0
RETRY_MAX_SECONDS = 60.0
REINIT_SECONDS = 60.0  # NVML unavailable: try nvmlInit again this often
RESCAN_SECONDS = 60.0  # look for GPUs that appeared
LOST_ERRORS = ("NVMLError_GpuIsLost", "NVMLError_Unknown", "NVMLError_ResetRequired")


class PowerIntegrator:
    """Sample-and-hold integral of instant power on one monotonic clock, safe across threads.

    Each sample's power holds until the next sample, so the integral at any instant is exact for the
    sampled step function and never decreases. A gap longer than ``max_gap_seconds`` between samples is
    not bridged: ``segment`` increments and the reader re-bases (rule 3: no guessed energy).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 max_gap_seconds: float = MAX_SAMPLE_GAP_SECONDS) -> None:
        self.clock = clock
        self.max_gap_seconds = max_gap_seconds
        self._lock = threading.Lock()
        self._joules = 0.0
        self._last_t: float | None = None
        self._last_watts = 0.0
        self.segment = 0
        self.samples = 0
        self.error: Exception | None = None  # a lost-GPU error seen by the sampler, for read() to act on
        self.failure = ""  # last per-field failure (nvmlReturn), for the status reason

    def add(self, watts: float) -> None:
        with self._lock:
            t = self.clock()
            if self._last_t is not None:
                dt = t - self._last_t
                if dt <= self.max_gap_seconds:
                    self._joules += self._last_watts * dt
                else:
                    self.segment += 1
            self._last_t, self._last_watts = t, watts
            self.samples += 1
            self.failure = ""

    def fail(self, reason: str) -> None:
        """A sample could not be taken: the hold stops here; the next good sample opens a new segment."""
        with self._lock:
            if self._last_t is not None:
                self.segment += 1
            self._last_t = None
            self.failure = reason

    def joules_now(self) -> tuple[float | None, int]:
        """(integral up to now, segment), or (None, segment) when the last sample is too old."""
        with self._lock:
            if self._last_t is None:
                return None, self.segment
            dt = self.clock() - self._last_t
            if dt > self.max_gap_seconds:
                return None, self.segment
            return self._joules + self._last_watts * max(dt, 0.0), self.segment


@dataclass
class _Gpu:
    uuid: str
    index: int
    handle: Any
    method: str  # counter | power_integration
    total_joules: float = 0.0
    prev_raw: float | None = None  # counter: mJ; power_integration: integrator joules
    prev_segment: int = 0
    prev_t: float | None = None
    down: str = ""  # reason while the GPU is marked down
    retry_at: float = 0.0
    backoff_seconds: float = RETRY_INITIAL_SECONDS
    integrator: PowerIntegrator | None = None
    labels: dict[str, str] = field(default_factory=dict)
    pending: Future | None = None  # a task that missed its deadline and may still be running

    @property
    def device(self) -> str:
        return f"gpu:{self.uuid}"

    def describe(self) -> str:
        return f"{self.uuid} (gpu {self.index})"


class NvmlSource:
    """``read(t)`` returns one DeviceReading per known GPU. ``t`` is the daemon's monotonic tick time
    (time.monotonic(); the integration thread uses the same clock). ``module`` injects a pynvml-compatible
    module (tests use the double in tests/support/fake_nvml); by default ``pynvml`` is imported."""

    name = "nvml"

    def __init__(self, enabled: bool = True, module: Any = None, sample_hz: float = SAMPLE_HZ,
                 clock: Callable[[], float] = time.monotonic, max_workers: int | None = None) -> None:
        self.enabled = enabled
        self.max_workers = max_workers  # None: one reader thread per GPU (1: the GPUs one after another)
        self.sample_hz = sample_hz
        self.clock = clock
        self.nvml = module
        self._gpus: dict[str, _Gpu] = {}
        self._unavailable = "disabled: nvml: false in the configuration" if not enabled else ""
        self._init_at: float | None = None
        self._scan_at: float | None = None
        self._initialized = False
        self._sampler: _Sampler | None = None
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()  # one read() at a time (the state below is the reader's)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0

    # --- NVML lifecycle ---------------------------------------------------------------------------------
    def _try_init(self, t: float) -> bool:
        if self._initialized:
            return True
        if not self.enabled or (self._init_at is not None and t - self._init_at < REINIT_SECONDS):
            return False
        self._init_at = t
        try:
            if self.nvml is None:
                self.nvml = importlib.import_module("pynvml")
            self.nvml.nvmlInit()
        except ImportError:
            self._unavailable = "absent: the pynvml module (nvidia-ml-py) is not installed"
            return False
        except Exception as e:  # NVMLError subclasses; the module's own class, so matched by name
            self._unavailable = _unavailable_reason(e)
            return False
        self._initialized, self._unavailable = True, ""
        return True

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._sampler:
            self._sampler.stop()
            self._sampler = None
        if self._initialized:
            try:
                self.nvml.nvmlShutdown()
            except Exception:  # shutting down: nothing useful to do with an error
                pass
            self._initialized = False

    # --- discovery --------------------------------------------------------------------------------------
    def _scan(self, t: float) -> None:
        self._scan_at = t
        nv = self.nvml
        try:
            count = nv.nvmlDeviceGetCount()
        except Exception as e:
            log.warning("nvml: cannot count GPUs: %s", e)
            return
        found: list[tuple[int, Any, str]] = []
        for index in range(count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(nv.nvmlDeviceGetUUID(handle))
            except Exception:
                continue  # a lost GPU at discovery; picked up by a later scan once it is back
            if uuid not in self._gpus:
                found.append((index, handle, uuid))
        # probing the counter is an energy read (~3 ms on an H100): all new GPUs at once
        methods = list(self._executor(len(self._gpus) + len(found)).map(self._method, [h for _, h, _ in found])) \
            if found else []
        for (index, handle, uuid), method in zip(found, methods):
            gpu = _Gpu(uuid, index, handle, method, labels={"gpu": str(index), "uuid": uuid})
            if gpu.method == "power_integration":
                gpu.integrator = PowerIntegrator(self.clock)
                sample_power(nv, gpu)  # one sample now, so the first read already has a hold value
            with self._lock:
                self._gpus[uuid] = gpu
            log.info("nvml: GPU %s measured by %s", gpu.describe(), gpu.method)
        self._start_sampler()

    def _method(self, handle: Any) -> str:
        try:
            self.nvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            return "counter"
        except Exception as e:
            if type(e).__name__ in ("NVMLError_NotSupported", "NVMLError_FunctionNotFound"):
                return "power_integration"
            return "counter"  # lost or transient: the counter is tried again at each read

    def _start_sampler(self) -> None:
        if self._sampler is None and any(g.integrator for g in self._gpus.values()):
            self._sampler = _Sampler(self, 1.0 / self.sample_hz)
            self._sampler.start()

    def integrating(self) -> list[_Gpu]:
        with self._lock:
            return [g for g in self._gpus.values() if g.integrator is not None and not g.down]

    # --- reading ----------------------------------------------------------------------------------------
    def read(self, t: float, deadline_seconds: float | None = None) -> tuple[SourceStatus, list[DeviceReading]]:
        """One DeviceReading per known GPU, the GPUs read concurrently. A GPU whose NVML calls have not
        returned ``deadline_seconds`` after the read began gets a no-sample reading with a reason (None: wait
        for every GPU)."""
        with self._read_lock:
            return self._read(t, deadline_seconds)

    def _read(self, t: float, deadline_seconds: float | None) -> tuple[SourceStatus, list[DeviceReading]]:
        started = time.perf_counter()
        if not self._try_init(t):
            return SourceStatus(source="nvml", server="", up=False, reason=self._unavailable,
                                duration_seconds=time.perf_counter() - started, state="down"), []
        if self._scan_at is None or t - self._scan_at >= RESCAN_SECONDS:
            self._scan(t)
        gpus = list(self._gpus.values())
        outcomes: dict[str, tuple[DeviceReading, str]] = {}
        tasks: dict[Future, _Gpu] = {}
        for gpu in gpus:
            if gpu.pending is not None:
                if not gpu.pending.done():  # never two reads of one GPU at once
                    outcomes[gpu.uuid] = self._no_sample(gpu), f"busy: {gpu.describe()}: a late read still runs"
                    continue
                gpu.pending = None  # its late result is dropped; prev_raw was cleared when it missed
            recover = bool(gpu.down)
            if recover and t < gpu.retry_at:
                outcomes[gpu.uuid] = self._no_sample(gpu), f"gpu lost: {gpu.describe()}: {gpu.down}"
                continue
            try:
                tasks[self._executor(len(gpus)).submit(self._fetch, gpu, gpu.handle, recover)] = gpu
            except RuntimeError as e:  # the pool was shut down under us (close() from another thread)
                outcomes[gpu.uuid] = self._no_sample(gpu), f"error: {gpu.describe()}: {e}"
        if tasks:
            remaining = None
            if deadline_seconds is not None:
                remaining = max(deadline_seconds - (time.perf_counter() - started), 0.0)
            concurrent.futures.wait(tasks, timeout=remaining)
        for future, gpu in tasks.items():
            if future.done():
                try:
                    got = future.result()
                except BaseException as e:  # noqa: BLE001 -- a bug or a cancelled task: no sample, never a crash
                    got = _Fetched(error=e if isinstance(e, Exception) else RuntimeError(repr(e)))
                outcomes[gpu.uuid] = self._commit(gpu, got, t)
            else:
                outcomes[gpu.uuid] = self._missed(gpu, future, t, deadline_seconds)
        readings, failures = [], []
        for gpu in gpus:
            reading, failure = outcomes[gpu.uuid]
            readings.append(reading)
            if failure:
                failures.append(failure)
        return _status(readings, failures, time.perf_counter() - started), readings

    def _executor(self, gpus: int) -> ThreadPoolExecutor:
        """One worker per GPU: a GPU has at most one task in flight, so none ever waits for a worker."""
        want = max(gpus if self.max_workers is None else min(gpus, self.max_workers), 1)
        if self._pool is None or self._pool_size < want:
            if self._pool is not None:
                self._pool.shutdown(wait=False)  # its running tasks finish; their GPUs are marked pending
            self._pool_size = want
            self._pool = ThreadPoolExecutor(self._pool_size, thread_name_prefix="kvwatt-nvml-read")
        return self._pool

    def _fetch(self, gpu: _Gpu, handle: Any, recover: bool) -> _Fetched:
        """The NVML calls for one GPU, in a pool thread. Touches no state of the source (the integrator
        is thread-safe); ``_commit`` applies the result on the reading thread."""
        nv, out = self.nvml, _Fetched()
        if recover:
            try:
                handle = nv.nvmlDeviceGetHandleByUUID(gpu.uuid)
                if gpu.method == "counter":
                    nv.nvmlDeviceGetTotalEnergyConsumption(handle)
            except Exception as e:
                out.recover_error = e
                return out
            out.handle = handle
            if gpu.integrator is not None:
                gpu.integrator.fail("recovered")
                sample_power(nv, gpu, handle)  # a new segment starts here; the frozen total is kept
        try:
            if gpu.integrator is None:
                out.raw_mj = nv.nvmlDeviceGetTotalEnergyConsumption(handle)
                out.read_at = self.clock()
            out.milliwatts = self._optional(nv.nvmlDeviceGetPowerUsage, handle)
            out.temperature = self._optional(nv.nvmlDeviceGetTemperature, handle, _temp_sensor(nv))
            # the limit the driver holds the board to (mW): what its power cannot exceed (bounds.RELATIONS); a
            # binding without the call (an old nvidia-ml-py, the demo's simulated GPUs) gives none
            limit = getattr(nv, "nvmlDeviceGetEnforcedPowerLimit", None)
            out.limit_milliwatts = None if limit is None else self._optional(limit, handle)
        except Exception as e:
            out.error = e
        return out

    def _commit(self, gpu: _Gpu, got: _Fetched, t: float) -> tuple[DeviceReading, str]:
        if gpu.down:
            if got.recover_error is not None or got.handle is None:
                e = got.recover_error or got.error or RuntimeError("recovery failed")
                self._mark_down(gpu, t, str(e) or type(e).__name__)
                return self._no_sample(gpu), f"gpu lost: {gpu.describe()}: {gpu.down}"
            log.info("nvml: GPU %s is back", gpu.describe())
            gpu.handle, gpu.down, gpu.prev_raw = got.handle, "", None  # re-based: the counter stayed frozen
        try:
            if got.error is not None:
                raise got.error
            joules, continuous, read_at = self._energy(gpu, t, got)
        except Exception as e:
            if type(e).__name__ in LOST_ERRORS:
                self._mark_down(gpu, t, str(e) or type(e).__name__)
                return self._no_sample(gpu), f"gpu lost: {gpu.describe()}: {gpu.down}"
            gpu.prev_raw = None  # transient error: no sample now, re-base on the next read
            return self._no_sample(gpu), f"error: {gpu.describe()}: {e or type(e).__name__}"
        if joules is None:
            failure = (gpu.integrator.failure if gpu.integrator else "") or "no recent power sample"
            return self._no_sample(gpu), f"error: {gpu.describe()}: {failure}"
        return DeviceReading(device=gpu.device, kind="gpu", labels=dict(gpu.labels), joules_total=gpu.total_joules,
                             continuous=continuous,
                             power_watts=None if got.milliwatts is None else got.milliwatts / 1000.0, method=gpu.method,
                             temperature_celsius=None if got.temperature is None else float(got.temperature),
                             read_at=read_at,
                             power_limit_watts=None if not got.limit_milliwatts else got.limit_milliwatts / 1000.0), ""

    def _missed(self, gpu: _Gpu, future: Future, t: float, deadline: float | None) -> tuple[DeviceReading, str]:
        """The GPU's task is still running at the deadline: no sample (rule 3); its result will be dropped."""
        gpu.prev_raw = None  # re-based: the step across the late read is never used
        gpu.pending = None if future.cancel() else future  # one still queued (max_workers) never runs
        reason = f"NVML read took longer than the {deadline:.3f} s deadline"
        if gpu.down:  # a recovery attempt that hangs counts as a failed one (back-off grows)
            self._mark_down(gpu, t, reason)
            return self._no_sample(gpu), f"gpu lost: {gpu.describe()}: {gpu.down}"
        return self._no_sample(gpu), f"timeout: {gpu.describe()}: {reason}"

    def _energy(self, gpu: _Gpu, t: float, got: _Fetched) -> tuple[float | None, bool, float | None]:
        """Advance the GPU's corrected total; (total or None, continuous, when the energy was read)."""
        if gpu.integrator is not None:
            if gpu.integrator.error is not None:
                err, gpu.integrator.error = gpu.integrator.error, None
                raise err
            raw, segment = gpu.integrator.joules_now()
            read_at = self.clock()
            if raw is None:
                gpu.prev_raw = None
                return None, False, None
            raw_joules, same_run = raw, segment == gpu.prev_segment
            gpu.prev_segment = segment
        else:
            raw_joules, same_run, read_at = got.raw_mj / 1000.0, True, got.read_at
        continuous = self._step(gpu, raw_joules, t, same_run)
        return gpu.total_joules, continuous, read_at

    def _step(self, gpu: _Gpu, raw_joules: float, t: float, same_run: bool) -> bool:
        prev, prev_t = gpu.prev_raw, gpu.prev_t
        gpu.prev_raw, gpu.prev_t = raw_joules, t
        if prev is None or not same_run or raw_joules < prev:
            return False  # first read, a re-base, or a counter reset by a driver reload (rule 4)
        step = raw_joules - prev
        if prev_t is not None and t > prev_t and step / (t - prev_t) > MAX_PLAUSIBLE_WATTS:
            return False  # implausible power: dropped and re-based (rule 4)
        gpu.total_joules += step
        return True

    def _optional(self, fn: Callable, *args: Any) -> Any:
        """A gauge that may be unsupported on this GPU: None then; lost-GPU errors still propagate."""
        try:
            return fn(*args)
        except Exception as e:
            if type(e).__name__ in LOST_ERRORS:
                raise
            return None

    def _mark_down(self, gpu: _Gpu, t: float, reason: str) -> None:
        if not gpu.down:
            log.warning("nvml: GPU %s is down (%s); retrying by UUID with back-off", gpu.describe(), reason)
            gpu.backoff_seconds = RETRY_INITIAL_SECONDS
        else:
            gpu.backoff_seconds = min(gpu.backoff_seconds * 2, RETRY_MAX_SECONDS)
        gpu.down, gpu.retry_at, gpu.prev_raw = reason, t + gpu.backoff_seconds, None

    def _no_sample(self, gpu: _Gpu) -> DeviceReading:
        # rule 3: no sample, never a 0 J delta; the total stays frozen for when the GPU returns
        return DeviceReading(device=gpu.device, kind="gpu", labels=dict(gpu.labels), joules_total=None,
                             continuous=False, power_watts=None, method=gpu.method)


@dataclass
class _Fetched:
    """What one pool task got from NVML for one GPU (nothing is applied to the source until _commit)."""

    handle: Any = None  # the new handle after a recovery attempt that succeeded
    recover_error: Exception | None = None
    raw_mj: float | None = None  # counter GPUs: the total-energy counter
    read_at: float | None = None
    milliwatts: float | None = None
    temperature: float | None = None
    limit_milliwatts: float | None = None  # nvmlDeviceGetEnforcedPowerLimit
    error: Exception | None = None


class _Sampler(threading.Thread):
    """Polls NVML_FI_DEV_POWER_INSTANT for every GPU without the counter, at ``period`` seconds."""

    def __init__(self, source: NvmlSource, period_seconds: float) -> None:
        super().__init__(name="kvwatt-nvml-power", daemon=True)
        self.source, self.period_seconds = source, period_seconds
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=2.0)

    def run(self) -> None:
        next_t = time.monotonic()
        while not self._stop_event.is_set():
            for gpu in self.source.integrating():
                sample_power(self.source.nvml, gpu)
            next_t += self.period_seconds
            delay = next_t - time.monotonic()
            if delay < 0:  # fell behind: skip, never burst (the gap check decides if the integral holds)
                next_t, delay = time.monotonic(), 0.0
            self._stop_event.wait(delay)


def sample_power(nv: Any, gpu: _Gpu, handle: Any = None) -> None:
    """One instant-power sample into the GPU's integrator (rule 6: check nvmlReturn, read valueType's member)."""
    try:
        entry = nv.nvmlDeviceGetFieldValues(gpu.handle if handle is None else handle,
                                            [nv.NVML_FI_DEV_POWER_INSTANT])[0]
    except Exception as e:
        if type(e).__name__ in LOST_ERRORS:
            gpu.integrator.error = e
        gpu.integrator.fail(f"nvmlDeviceGetFieldValues: {e or type(e).__name__}")
        return
    if entry.nvmlReturn != nv.NVML_SUCCESS:
        gpu.integrator.fail(f"POWER_INSTANT nvmlReturn={entry.nvmlReturn}")
        return
    milliwatts = field_value(nv, entry)
    if milliwatts is None or not 0 <= milliwatts / 1000.0 <= MAX_PLAUSIBLE_WATTS:
        gpu.integrator.fail(f"POWER_INSTANT value {milliwatts!r} mW out of range")
        return
    gpu.integrator.add(milliwatts / 1000.0)


_UNION_MEMBERS = (("NVML_VALUE_TYPE_DOUBLE", "dVal"), ("NVML_VALUE_TYPE_UNSIGNED_INT", "uiVal"),
                  ("NVML_VALUE_TYPE_UNSIGNED_LONG", "ulVal"), ("NVML_VALUE_TYPE_UNSIGNED_LONG_LONG", "ullVal"),
                  ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", "sllVal"), ("NVML_VALUE_TYPE_SIGNED_INT", "siVal"),
                  ("NVML_VALUE_TYPE_UNSIGNED_SHORT", "usVal"))


def field_value(nv: Any, entry: Any) -> float | None:
    """The value of a c_nvmlFieldValue_t, from the union member its valueType names (None if unknown type)."""
    for const, member in _UNION_MEMBERS:
        if entry.valueType == getattr(nv, const, -1):
            return float(getattr(entry.value, member))
    return None


def _temp_sensor(nv: Any) -> int:
    return getattr(nv, "NVML_TEMPERATURE_GPU", 0)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _unavailable_reason(e: Exception) -> str:
    name = type(e).__name__
    if name == "NVMLError_LibraryNotFound":
        return "absent: NVML library (libnvidia-ml.so.1) not found"
    if name == "NVMLError_DriverNotLoaded":
        return "absent: NVIDIA driver not loaded"
    if name == "NVMLError_NoPermission":
        return f"permission: {e}"
    return f"error: nvmlInit failed: {e or name}"


def _status(readings: list[DeviceReading], failures: list[str], seconds: float) -> SourceStatus:
    if not readings:
        return SourceStatus(source="nvml", server="", up=False, reason="absent: NVML reports no GPU",
                            duration_seconds=seconds, state="down")
    ok = sum(r.joules_total is not None for r in readings)
    reason = "; ".join(failures)
    if ok == 0:
        return SourceStatus(source="nvml", server="", up=False, reason=reason, duration_seconds=seconds, state="down")
    return SourceStatus(source="nvml", server="", up=True, reason=reason, duration_seconds=seconds,
                        state="degraded" if failures else "ok")
