"""Reading input files (YAML, JSON; bounded, one-line errors) and checking an output path before the work."""

from __future__ import annotations

import json
import os
from typing import Any

import yaml

from exporter.config.schema import Config
from exporter.config.settings import from_mapping
from exporter.config.values import ConfigError, parse_str
from exporter.rules.limits import MAX_FILE_BYTES


def read_text(path: str) -> str:
    """A file's text (UTF-8, at most MAX_FILE_BYTES), or ConfigError with one line naming the file and the
    problem."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)  # bounded: the path may be /dev/zero or a 10 GB mistake
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_FILE_BYTES // 2**20} MiB (the limit)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}: line {line}: not valid UTF-8 (byte 0x{data[e.start]:02x})") from None


def read_yaml(path: str) -> Any:
    """A YAML file's data, or ConfigError with one line naming the file and the problem."""
    text = read_text(path)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} not valid YAML ({getattr(e, 'problem', e)})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not usable YAML (nested too deeply)") from None
    except ValueError as e:  # the constructor's own: a date like 2024-13-45, an integer of 5,000 digits
        raise ConfigError(f"{path}: not usable YAML ({str(e).split(';')[0]})") from None


def read_json(path: str) -> Any:
    """A JSON file's data, or ConfigError with one line naming the file and the problem."""
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    except RecursionError:
        raise ConfigError(f"{path}: not usable JSON (nested too deeply)") from None
    except ValueError as e:  # an integer of more than 4,300 digits
        raise ConfigError(f"{path}: not usable JSON ({str(e).split(';')[0]})") from None


def check_writable(path: str, key: str, directory: bool = False) -> None:
    """ConfigError unless ``path`` can be created or replaced later as a file (or, with ``directory``, used as
    a directory): checked before any work, so a typo does not lose a long run's result at its end. Missing
    parents are fine (they are created); the nearest existing one must be a directory we may write in."""
    target = os.path.abspath(parse_str(path, key))
    if os.path.exists(target):
        if os.path.isdir(target) != directory:
            raise ConfigError(f"{key}: {path} is {'not ' if directory else ''}a directory")
        if not os.access(target, os.W_OK):
            raise ConfigError(f"{key}: cannot write {path} (permission denied)")
        return
    if not directory and path.endswith("/"):
        raise ConfigError(f"{key}: expected a file path, got a directory {path!r}")
    parent = os.path.dirname(target)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{key}: cannot write {path} ({parent} is not a directory)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: cannot write {path} (permission denied in {parent})")


def load_file(path: str) -> Config:
    return from_mapping(read_yaml(path))
