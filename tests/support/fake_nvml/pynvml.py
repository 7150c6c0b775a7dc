"""A test double for NVIDIA's ``pynvml`` (the nvidia-ml-py package), driven by a JSON state file.

Why a double: no machine this project develops or runs CI on has a GPU, and the behaviours kvwatt must get
right (a GPU lost mid-run, a driver reload resetting the energy counter, a GPU without the counter, no NVML
at all) cannot be produced on demand even on a machine that has one. So this module speaks pynvml's real
interface -- the same function names and signatures, the same ``NVML_ERROR_*`` codes and the same
``NVMLError`` subclass hierarchy (``NVMLError(15)`` is an ``NVMLError_GpuIsLost``), the same ctypes
``c_nvmlFieldValue_t`` with its ``c_nvmlValue_t`` union (reading the wrong union member gives garbage,
as on the real library) -- and takes the GPUs' state from a file tests can rewrite at any moment.
tests/test_energy_nvml.py checks every name and constant here against the installed real pynvml.
Constants and the error-class generator are copied from nvidia-ml-py (BSD-3-Clause, (c) NVIDIA).

Use it by putting this directory first on the import path::

    PYTHONPATH=tests/support/fake_nvml KVWATT_FAKE_NVML_STATE=/tmp/gpus.json kvwatt run ...

or, in-process, ``tests.support.fake_gpus.load_fake_nvml()`` (which also has ``FakeGpus``, a small builder
for the state file).

State file (``$KVWATT_FAKE_NVML_STATE``; unset or missing file = "NVML library not found")::

    {"library_found": true,          # false: nvmlInit raises NVMLError_LibraryNotFound
     "driver_loaded": true,          # false: nvmlInit raises NVMLError_DriverNotLoaded
     "gpus": [{
        "uuid": "GPU-...", "name": "NVIDIA H100 80GB HBM3",
        "energy_mj": 1000,           # total-energy counter (mJ since driver load); lower it = driver reload
        "power_mw": 300000,          # constant power (instant field and nvmlDeviceGetPowerUsage)
        "power_profile": {"base_mw": 300000, "amplitude_mw": 100000, "period_s": 2.0, "t0": 123.4},
                                     # optional sine: P(t) = base + amplitude*sin(2*pi*(t-t0)/period),
                                     # t in time.monotonic() seconds (system-wide, so shared by processes)
        "counter_follows_power": false,   # true: counter = energy_mj + integral of power since "t0"
        "t0": 123.4,                 # monotonic start for counter_follows_power with a constant power
        "temperature_c": 40,
        "power_limit_mw": 700000,    # nvmlDeviceGetEnforcedPowerLimit; absent: NotSupported (as on some boards)
        "has_energy_counter": true,  # false: nvmlDeviceGetTotalEnergyConsumption -> NotSupported
        "lost": false,               # true: every call on this GPU raises NVMLError_GpuIsLost
        "error": null,               # or an NVML_ERROR_ suffix ("RESET_REQUIRED", "UNKNOWN") raised by every call
        "field_return": null,        # or an NVML_ERROR_ suffix put in the POWER_INSTANT entry's nvmlReturn
        "field_value_type": "UNSIGNED_INT"   # NVML_VALUE_TYPE_ suffix the POWER_INSTANT value is stored as
     }],
     "energy_read_latency": "h100",  # what one energy-counter read costs: "h100" (default, below), 0 (free),
                                     # or a constant number of milliseconds; a GPU entry may carry its own
     "fast_read_latency_us": 5}      # what a power / temperature / field read costs, in microseconds

Why reads cost time here: on a real H100 (driver 580) ``nvmlDeviceGetTotalEnergyConsumption`` takes 3.0 ms
median, 5.6-7.0 ms at p90 and up to 18 ms per call, while power, temperature and the POWER_INSTANT field
take 3-7 us. Eight GPUs read one after the other then cost ~25 ms a tick, with tails past 50 ms; a double
that answers in microseconds would hide exactly the behaviour kvwatt's concurrent reads and deadlines exist
for. So by default the energy read sleeps a lognormal time with median 3.0 ms and p90 6.5 ms, capped at
18 ms (``energy_read_latency_seconds``). ``time.sleep`` releases the GIL as ctypes does around the real
call, so concurrent reads overlap as they do against libnvidia-ml. The fast reads spin for
``fast_read_latency_us`` (a sleep that short would oversleep by ~50 us on Linux); re-reading the state file
adds a few tens of microseconds to every call on top (that part is the double's own cost).

``write_state(path, state)`` replaces the file atomically so a reader never sees half of it.
"""

from __future__ import annotations

import json
import math
import os
import random
import string
import sys
import tempfile
import threading
import time
from ctypes import (
    Structure,
    Union,
    c_double,
    c_int,
    c_int64,
    c_longlong,
    c_uint,
    c_uint32,
    c_ulong,
    c_ulonglong,
    c_ushort,
)

STATE_ENV = "KVWATT_FAKE_NVML_STATE"
__fake__ = True  # lets a test tell this module from the real one

# --- constants copied from nvidia-ml-py ------------------------------------------------------------------
_nvmlReturn_t = c_uint
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_INSUFFICIENT_POWER = 8
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_IRQ_ISSUE = 11
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_CORRUPTED_INFOROM = 14
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_RESET_REQUIRED = 16
NVML_ERROR_OPERATING_SYSTEM = 17
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_IN_USE = 19
NVML_ERROR_MEMORY = 20
NVML_ERROR_NO_DATA = 21
NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_FREQ_NOT_SUPPORTED = 24
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_DEPRECATED = 26
NVML_ERROR_NOT_READY = 27
NVML_ERROR_GPU_NOT_FOUND = 28
NVML_ERROR_INVALID_STATE = 29
NVML_ERROR_RESET_TYPE_NOT_SUPPORTED = 30
NVML_ERROR_UNKNOWN = 999

_nvmlValueType_t = c_uint
NVML_VALUE_TYPE_DOUBLE = 0
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_VALUE_TYPE_UNSIGNED_LONG = 2
NVML_VALUE_TYPE_UNSIGNED_LONG_LONG = 3
NVML_VALUE_TYPE_SIGNED_LONG_LONG = 4
NVML_VALUE_TYPE_SIGNED_INT = 5
NVML_VALUE_TYPE_UNSIGNED_SHORT = 6
NVML_VALUE_TYPE_COUNT = 7

NVML_TEMPERATURE_GPU = 0
NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION = 83
NVML_FI_DEV_POWER_AVERAGE = 185
NVML_FI_DEV_POWER_INSTANT = 186


class c_nvmlValue_t(Union):
    _fields_ = [
        ('dVal', c_double),
        ('uiVal', c_uint),
        ('ulVal', c_ulong),
        ('ullVal', c_ulonglong),
        ('sllVal', c_longlong),
        ('siVal', c_int),
        ('usVal', c_ushort),
    ]


class c_nvmlFieldValue_t(Structure):
    _fields_ = [
        ('fieldId', c_uint32),
        ('scopeId', c_uint32),
        ('timestamp', c_int64),
        ('latencyUsec', c_int64),
        ('valueType', _nvmlValueType_t),
        ('nvmlReturn', _nvmlReturn_t),
        ('value', c_nvmlValue_t)
    ]


class NVMLError(Exception):
    _valClassMapping = dict()
    _errcode_to_string = {
        NVML_ERROR_UNINITIALIZED: "Uninitialized",
        NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
        NVML_ERROR_NOT_SUPPORTED: "Not Supported",
        NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
        NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized",
        NVML_ERROR_NOT_FOUND: "Not Found",
        NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size",
        NVML_ERROR_INSUFFICIENT_POWER: "Insufficient External Power",
        NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
        NVML_ERROR_TIMEOUT: "Timeout",
        NVML_ERROR_IRQ_ISSUE: "Interrupt Request Issue",
        NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
        NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found",
        NVML_ERROR_CORRUPTED_INFOROM: "Corrupted infoROM",
        NVML_ERROR_GPU_IS_LOST: "GPU is lost",
        NVML_ERROR_RESET_REQUIRED: "GPU requires restart",
        NVML_ERROR_OPERATING_SYSTEM: "The operating system has blocked the request.",
        NVML_ERROR_LIB_RM_VERSION_MISMATCH: "RM has detected an NVML/RM version mismatch.",
        NVML_ERROR_MEMORY: "Insufficient Memory",
        NVML_ERROR_UNKNOWN: "Unknown Error",
    }

    def __new__(typ, value):
        if typ == NVMLError:
            typ = NVMLError._valClassMapping.get(value, typ)
        obj = Exception.__new__(typ)
        obj.value = value
        return obj

    def __str__(self):
        return NVMLError._errcode_to_string.get(self.value, "NVML Error with code %d" % self.value)

    def __eq__(self, other):
        return self.value == other.value

    __hash__ = Exception.__hash__


def nvmlExceptionClass(nvmlErrorCode):
    if nvmlErrorCode not in NVMLError._valClassMapping:
        raise ValueError('nvmlErrorCode %s is not valid' % nvmlErrorCode)
    return NVMLError._valClassMapping[nvmlErrorCode]


def _extractNVMLErrorsAsClasses():
    """Same generator as the real module: NVML_ERROR_GPU_IS_LOST -> NVMLError_GpuIsLost."""
    this_module = sys.modules[__name__]
    for err_name in [x for x in dir(this_module) if x.startswith("NVML_ERROR_")]:
        class_name = "NVMLError_" + string.capwords(err_name.replace("NVML_ERROR_", ""), "_").replace("_", "")
        err_val = getattr(this_module, err_name)

        def gen_new(val):
            def new(typ, *args):
                return NVMLError.__new__(typ, val)
            return new
        new_error_class = type(class_name, (NVMLError,), {'__new__': gen_new(err_val)})
        new_error_class.__module__ = __name__
        setattr(this_module, class_name, new_error_class)
        NVMLError._valClassMapping[err_val] = new_error_class


_extractNVMLErrorsAsClasses()

# --- latency model (see the module docstring) -------------------------------------------------------------
H100_ENERGY_MEDIAN_SECONDS = 3.0e-3
H100_ENERGY_P90_SECONDS = 6.5e-3
H100_ENERGY_MAX_SECONDS = 18e-3
_Z90 = 1.2815515655446004  # standard normal quantile at 0.9
_H100_SIGMA = math.log(H100_ENERGY_P90_SECONDS / H100_ENERGY_MEDIAN_SECONDS) / _Z90
DEFAULT_FAST_READ_US = 5.0
_rng = random.Random()
_rng_lock = threading.Lock()


def energy_read_latency_seconds(state: dict | None, gpu: dict | None = None) -> float:
    """How long this energy-counter read takes: the GPU's ``energy_read_latency`` if it has one, else the
    state's top-level one ("h100" when neither says)."""
    spec = (gpu or {}).get("energy_read_latency", (state or {}).get("energy_read_latency", "h100"))
    if spec == "h100":
        with _rng_lock:
            z = _rng.gauss(0.0, 1.0)
        return min(H100_ENERGY_MEDIAN_SECONDS * math.exp(_H100_SIGMA * z), H100_ENERGY_MAX_SECONDS)
    if not spec:
        return 0.0
    return max(float(spec), 0.0) / 1000.0


def _energy_read_delay(state: dict | None, gpu: dict | None = None) -> None:
    seconds = energy_read_latency_seconds(state, gpu)
    if seconds > 0:
        time.sleep(seconds)  # releases the GIL, as ctypes does around the real call


def _fast_read_delay(state: dict | None) -> None:
    us = (state or {}).get("fast_read_latency_us", DEFAULT_FAST_READ_US)
    if us and us > 0:
        end = time.perf_counter() + us / 1e6
        while time.perf_counter() < end:
            pass


# --- state ------------------------------------------------------------------------------------------------
_lock = threading.Lock()
_refcount = 0


class c_nvmlDevice_t:
    """Opaque handle, like the real POINTER(struct_c_nvmlDevice_t); carries the GPU's UUID."""

    __slots__ = ("uuid",)

    def __init__(self, uuid: str) -> None:
        self.uuid = uuid

    def __repr__(self) -> str:
        return f"<fake nvmlDevice {self.uuid}>"


def write_state(path: str, state: dict) -> None:
    """Replace the state file atomically (write a temporary file, rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".fake-nvml-", dir=directory)
    with os.fdopen(fd, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)


def _state() -> dict | None:
    path = os.environ.get(STATE_ENV)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _raise(code: int):
    raise NVMLError(code)


def _err_code(suffix: str) -> int:
    return getattr(sys.modules[__name__], "NVML_ERROR_" + suffix)


def _initialized_state() -> dict:
    if _refcount <= 0:
        _raise(NVML_ERROR_UNINITIALIZED)
    state = _state()
    if state is None or not state.get("library_found", True):
        _raise(NVML_ERROR_UNINITIALIZED)  # the state vanished under a running process
    if not state.get("driver_loaded", True):
        _raise(NVML_ERROR_DRIVER_NOT_LOADED)
    return state


def _gpu(handle) -> dict:
    return _gpu_and_state(handle)[0]


def _gpu_and_state(handle) -> tuple[dict, dict]:
    state = _initialized_state()
    for g in state.get("gpus", []):
        if g["uuid"] == handle.uuid:
            if g.get("lost"):
                _raise(NVML_ERROR_GPU_IS_LOST)
            if g.get("error"):
                _raise(_err_code(g["error"]))
            return g, state
    _raise(NVML_ERROR_GPU_IS_LOST)  # the GPU fell off the bus


def power_mw_at(gpu: dict, now: float) -> float:
    prof = gpu.get("power_profile")
    if not prof:
        return float(gpu.get("power_mw", 0.0))
    phase = 2 * math.pi * (now - prof["t0"]) / prof["period_s"]
    return prof["base_mw"] + prof["amplitude_mw"] * math.sin(phase)


def energy_mj_between(gpu: dict, t_a: float, t_b: float) -> float:
    """Exact integral of the GPU's power (mW) over [t_a, t_b] in mJ: what tests compare against."""
    prof = gpu.get("power_profile")
    if not prof:
        return float(gpu.get("power_mw", 0.0)) * (t_b - t_a)
    w = 2 * math.pi / prof["period_s"]
    cos_a, cos_b = math.cos(w * (t_a - prof["t0"])), math.cos(w * (t_b - prof["t0"]))
    return prof["base_mw"] * (t_b - t_a) + prof["amplitude_mw"] * (cos_a - cos_b) / w


def _energy_mj(gpu: dict, now: float) -> int:
    base = float(gpu.get("energy_mj", 0))
    if gpu.get("counter_follows_power"):
        t0 = gpu.get("t0", (gpu.get("power_profile") or {}).get("t0", now))
        base += energy_mj_between(gpu, t0, now)
    return int(base)


# --- the interface ----------------------------------------------------------------------------------------
def nvmlInitWithFlags(flags):
    global _refcount
    state = _state()
    if state is None or not state.get("library_found", True):
        _raise(NVML_ERROR_LIBRARY_NOT_FOUND)
    if not state.get("driver_loaded", True):
        _raise(NVML_ERROR_DRIVER_NOT_LOADED)
    with _lock:
        _refcount += 1
    return None


def nvmlInit():
    nvmlInitWithFlags(0)
    return None


def nvmlShutdown():
    global _refcount
    if _refcount <= 0:
        _raise(NVML_ERROR_UNINITIALIZED)
    with _lock:
        _refcount -= 1
    return None


def nvmlErrorString(result):
    return NVMLError._errcode_to_string.get(result, "Unknown Error")


def nvmlSystemGetDriverVersion():
    return str(_initialized_state().get("driver_version", "550.54.15"))


def nvmlDeviceGetCount():
    return len(_initialized_state().get("gpus", []))


def nvmlDeviceGetHandleByIndex(index):
    gpus = _initialized_state().get("gpus", [])
    if not 0 <= index < len(gpus):
        _raise(NVML_ERROR_INVALID_ARGUMENT)
    handle = c_nvmlDevice_t(gpus[index]["uuid"])
    _gpu(handle)  # a lost GPU fails here too, as on the real library
    return handle


def nvmlDeviceGetHandleByUUID(uuid):
    uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
    if not any(g["uuid"] == uuid for g in _initialized_state().get("gpus", [])):
        _raise(NVML_ERROR_NOT_FOUND)
    handle = c_nvmlDevice_t(uuid)
    _gpu(handle)
    return handle


def nvmlDeviceGetUUID(handle):
    return _gpu(handle)["uuid"]


def nvmlDeviceGetName(handle):
    return _gpu(handle).get("name", "NVIDIA H100 80GB HBM3")


def nvmlDeviceGetIndex(handle):
    gpu = _gpu(handle)
    return _initialized_state()["gpus"].index(gpu)


def nvmlDeviceGetTotalEnergyConsumption(handle):
    gpu, state = _gpu_and_state(handle)
    if not gpu.get("has_energy_counter", True):
        _raise(NVML_ERROR_NOT_SUPPORTED)
    _energy_read_delay(state, gpu)
    return _energy_mj(gpu, time.monotonic())


def nvmlDeviceGetPowerUsage(handle):
    gpu, state = _gpu_and_state(handle)
    if not gpu.get("has_power_usage", True):
        _raise(NVML_ERROR_NOT_SUPPORTED)
    _fast_read_delay(state)
    return int(power_mw_at(gpu, time.monotonic()))


def nvmlDeviceGetEnforcedPowerLimit(handle):
    gpu, state = _gpu_and_state(handle)
    if gpu.get("power_limit_mw") is None:
        _raise(NVML_ERROR_NOT_SUPPORTED)
    _fast_read_delay(state)
    return int(gpu["power_limit_mw"])


def nvmlDeviceGetTemperature(handle, sensor):
    gpu, state = _gpu_and_state(handle)
    _fast_read_delay(state)
    if sensor != NVML_TEMPERATURE_GPU:
        _raise(NVML_ERROR_NOT_SUPPORTED)
    return int(gpu.get("temperature_c", 40))


_UNION_MEMBER = {NVML_VALUE_TYPE_DOUBLE: "dVal", NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
                 NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal", NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
                 NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal", NVML_VALUE_TYPE_SIGNED_INT: "siVal",
                 NVML_VALUE_TYPE_UNSIGNED_SHORT: "usVal"}


def _fill(entry, gpu: dict, now: float) -> None:
    entry.timestamp = int(time.time() * 1e6)
    if entry.fieldId == NVML_FI_DEV_POWER_INSTANT:
        if gpu.get("field_return"):
            entry.nvmlReturn = _err_code(gpu["field_return"])
            return
        value_type = getattr(sys.modules[__name__], "NVML_VALUE_TYPE_" + gpu.get("field_value_type", "UNSIGNED_INT"))
        value = power_mw_at(gpu, now)
    elif entry.fieldId == NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION and gpu.get("has_energy_counter", True):
        value_type, value = NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, _energy_mj(gpu, now)
    else:
        entry.nvmlReturn = NVML_ERROR_NOT_SUPPORTED
        return
    entry.valueType = value_type
    member = _UNION_MEMBER[value_type]
    setattr(entry.value, member, value if member == "dVal" else int(value))
    entry.nvmlReturn = NVML_SUCCESS


def nvmlDeviceGetFieldValues(handle, fieldIds):
    gpu, state = _gpu_and_state(handle)
    if any((f[0] if isinstance(f, tuple) else f) == NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION for f in fieldIds):
        _energy_read_delay(state, gpu)  # the energy field costs what the energy call costs
    else:
        _fast_read_delay(state)
    values = (c_nvmlFieldValue_t * len(fieldIds))()
    now = time.monotonic()
    for i, fieldId in enumerate(fieldIds):
        try:
            (values[i].fieldId, values[i].scopeId) = fieldId
        except TypeError:
            values[i].fieldId = fieldId
        _fill(values[i], gpu, now)
    return values
