"""Deployment artefacts: Dockerfile, the compose stack, the Kubernetes manifests, the fleet rules.

Docker cannot build or run on these machines and there is no cluster, so each artefact is checked by what can
run here:
- the image: its build stage is replayed outside Docker (same COPY and RUN lines, paths under a temp root),
  its install step is the very command the test suite runs, its HEALTHCHECK runs against a real daemon;
- compose.yaml: the compose-spec JSON schema (vendored, tests/data/SCHEMAS.md), then every mounted file,
  port and label against the project's own files;
- Kubernetes: kubernetes-validate's bundled OpenAPI schemas (strict, offline) for core kinds, the Prometheus
  Operator's CRD schemas (vendored) for ServiceMonitor/PrometheusRule, and the same cross-checks;
- Prometheus and Alertmanager configuration: loaded by the real promtool / amtool from a directory laid out
  as the containers see it (their bind mounts), so a wrong mount path fails the test.
Each validator is also shown a broken copy and must reject it.
"""

from __future__ import annotations

import copy
import http.server
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import pytest
import yaml
from kvwatt_lab.experiment.server import free_port

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
COMPOSE_DIR = REPO / "deploy" / "compose"
COMPOSE_FILE = COMPOSE_DIR / "compose.yaml"
K8S_DIR = REPO / "deploy" / "kubernetes"
FLEET_DIR = REPO / "deploy" / "fleet"
ALERTS = REPO / "alerts"
DASHBOARDS = REPO / "dashboards"
KVWATT_PORT = 8492  # the default listen address 0.0.0.0:8492 (exporter/config/values.py DEFAULT_LISTEN)
K8S_VERSION = "1.37"

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def load_yaml(path: Path):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def load_yaml_all(path: Path) -> list:
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def pyproject_version() -> str:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


def tool(name: str) -> str:
    path = shutil.which(name)
    if not path:
        pytest.skip(f"{name} is not installed (scripts/install-deps.sh installs it)")
    return path


# --- Dockerfile -------------------------------------------------------------------------------------------

@dataclass
class Instr:
    cmd: str
    args: str
    stage: str  # the stage's name (AS ...) or its index; "" before the first FROM


def parse_dockerfile(text: str) -> list[Instr]:
    """Instructions with line continuations joined and comments dropped (Docker's rules, no heredocs)."""
    out: list[Instr] = []
    buf = ""
    stage = ""
    count = -1
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not buf and not line):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        cmd, _, args = buf.partition(" ")
        cmd = cmd.upper()
        args = args.strip()
        if cmd == "FROM":
            count += 1
            m = re.search(r"\s+AS\s+(\S+)$", args, re.IGNORECASE)
            stage = m.group(1) if m else str(count)
        out.append(Instr(cmd, args, stage))
        buf = ""
    return out


DOCKERFILE_TEXT = (REPO / "Dockerfile").read_text(encoding="utf-8")
DOCKERFILE = parse_dockerfile(DOCKERFILE_TEXT)


def instrs(cmd: str, stage: str | None = None) -> list[Instr]:
    return [i for i in DOCKERFILE if i.cmd == cmd and (stage is None or i.stage == stage)]


def final_stage() -> str:
    return instrs("FROM")[-1].stage


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def shell_commands(text: str) -> list[list[str]]:
    """Simple commands of a shell line: split on && || ; and newlines, then shlex (enough for our scripts)."""
    cmds = []
    for part in re.split(r"&&|\|\||;|\n", text):
        part = part.strip()
        if part and not part.startswith("#"):
            try:
                cmds.append(shlex.split(part, comments=True))
            except ValueError:
                continue
    return [c for c in cmds if c]


def install_calls(commands: list[list[str]]) -> list[list[str]]:
    """argv of every call of scripts/install-kvwatt.sh (after `if`/`then` and the like)."""
    calls = []
    for argv in commands:
        for i, word in enumerate(argv):
            if word.endswith("scripts/install-kvwatt.sh"):
                calls.append(argv[i:])
                break
    return calls


PIP_INSTALL_RE = re.compile(r"\b(pip3?|uv)\b[^\n]*\binstall\b|setup\.py\s+install|easy_install")


def test_dockerfile_installs_kvwatt_with_the_test_suites_command():
    """(a) The image's install step is the script and pip command the test suite runs."""
    build_runs = [i for i in instrs("RUN")]
    docker_calls = install_calls([c for r in build_runs for c in shell_commands(r.args)])
    assert len(docker_calls) == 1, f"the Dockerfile must install kvwatt once, via the script: {docker_calls}"
    # nothing else installs Python packages in the image
    for r in build_runs:
        if "install-kvwatt.sh" not in r.args:
            assert not PIP_INSTALL_RE.search(r.args), f"a second install path in the Dockerfile: RUN {r.args}"

    # the test suite's Python environment (make test via install-deps.sh, make test-fast directly)
    deps = (REPO / "scripts" / "install-python.sh").read_text(encoding="utf-8")
    assert "scripts/install-python.sh" in (REPO / "scripts" / "install-deps.sh").read_text(encoding="utf-8")
    test_calls = install_calls(shell_commands(deps))
    assert len(test_calls) == 1, f"scripts/install-python.sh must call install-kvwatt.sh once: {test_calls}"

    (d_script, d_pip, d_target, *d_extra), = docker_calls
    (t_script, t_pip, t_target, *t_extra), = test_calls
    assert Path(d_script).name == Path(t_script).name == "install-kvwatt.sh"
    assert os.access(REPO / "scripts" / "install-kvwatt.sh", os.X_OK), "both run the script directly"
    # the same script file: the Dockerfile copies it from the repo to the path it runs
    copied = [exec_or_words(c.args) for c in instrs("COPY") if "install-kvwatt.sh" in c.args]
    assert copied and copied[0][0] == "scripts/install-kvwatt.sh", copied
    # pip of a virtual environment the same command creates
    assert d_pip.endswith("/bin/pip") and t_pip.endswith("/bin/pip"), (d_pip, t_pip)
    d_venv = d_pip.removesuffix("/bin/pip")
    assert any(c[-3:] == ["-m", "venv", d_venv] for r in build_runs for c in shell_commands(r.args)), \
        f"the Dockerfile must create {d_venv} with python -m venv"
    t_venv = t_pip.removesuffix("/bin/pip")
    assert re.search(rf'-m venv {re.escape(t_venv)}\b', deps), f"install-python.sh must create {t_venv}"
    # the same project: the repo root, with the test extras on the test side only
    assert d_target == "." and t_target.split("[")[0] == ".", (d_target, t_target)
    assert (REPO / "pyproject.toml").exists()
    assert set(t_extra) - set(d_extra) <= {"-e"} and set(d_extra) <= set(t_extra), (d_extra, t_extra)
    # the Makefile's `run` target uses the same script as well
    make = (REPO / "Makefile").read_text(encoding="utf-8")
    assert install_calls(shell_commands(make)), "the Makefile must install kvwatt with install-kvwatt.sh"
    # and the script is the single pip install
    script = (REPO / "scripts" / "install-kvwatt.sh").read_text(encoding="utf-8")
    assert len(PIP_INSTALL_RE.findall(script)) == 1 or script.count(" install ") == 1, script


def exec_or_words(args: str) -> list[str]:
    args = re.sub(r"^(--\S+\s+)+", "", args)  # --from=, --chown=
    return exec_form(args) if args.startswith("[") else args.split()


def test_dockerfile_shape():
    """Slim base, two stages, non-root, entrypoint, healthcheck, port, state volume."""
    args = {}
    for i in DOCKERFILE:
        if i.cmd == "ARG" and i.stage == "" and "=" in i.args:
            k, v = i.args.split("=", 1)
            args[k] = v
    bases = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], i.args.split()[0]) for i in instrs("FROM")]
    assert len(bases) >= 2, "multi-stage: build tools stay in the build stage"
    for b in bases:
        assert re.fullmatch(r"python:3\.11-slim(-\w+)?", b), f"base image {b} is not python:3.11-slim"
    final = final_stage()
    # the final stage installs nothing: it copies the venv from the build stage
    assert not instrs("RUN", final) or all(not PIP_INSTALL_RE.search(r.args) and "apt-get install" not in r.args
                                           for r in instrs("RUN", final))
    copies = [c.args for c in instrs("COPY", final) if c.args.startswith("--from=")]
    assert copies, "the final stage must copy the built environment from the build stage"
    src, dst = copies[0].split()[1:]
    assert src == dst, "the venv must keep its path (its scripts' #! lines point into it)"
    # non-root
    users = instrs("USER", final)
    assert users, "the image must not run as root"
    uid = users[-1].args.split(":")[0]
    assert uid not in ("0", "root"), uid
    # entrypoint: kvwatt run, from the venv on PATH
    assert exec_form(instrs("ENTRYPOINT", final)[-1].args) == ["kvwatt", "run"]
    env = " ".join(e.args for e in instrs("ENV", final))
    assert f"PATH={dst}/bin:" in env
    assert re.search(r"\bEXPOSE\s+8492\b", DOCKERFILE_TEXT)
    assert instrs("EXPOSE", final)[-1].args.split("/")[0] == str(KVWATT_PORT)
    vols = exec_form(instrs("VOLUME", final)[-1].args)
    assert "/var/lib/kvwatt" in vols and "KVWATT_STATE_DIR=/var/lib/kvwatt" in env
    assert "NVIDIA_DRIVER_CAPABILITIES=utility" in env
    hc = instrs("HEALTHCHECK", final)[-1].args
    assert "/healthz" in hc and "curl" not in hc and "wget" not in hc


def dockerfile_user() -> tuple[str, str]:
    uid, _, gid = instrs("USER", final_stage())[-1].args.partition(":")
    return uid, gid or uid


def healthcheck_argv() -> list[str]:
    args = instrs("HEALTHCHECK", final_stage())[-1].args
    _, _, cmd = args.partition("CMD")
    return exec_form(cmd.strip())


# .dockerignore: Docker's rules (moby/patternmatcher): the last pattern matching a path or one of its parents wins.
def _glob_re(pattern: str) -> re.Pattern:
    out = ""
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
            continue
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            continue
        out += "[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c)
        i += 1
    return re.compile(out)


def dockerignored(path: str, patterns: list[str]) -> bool:
    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for pat in patterns:
        negate = pat.startswith("!")
        rx = _glob_re(os.path.normpath(pat.lstrip("!").strip().strip("/")))
        if any(rx.fullmatch(p) for p in prefixes):
            excluded = not negate
    return excluded


def dockerignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def test_dockerignore_keeps_context_small_and_copy_sources_in():
    pats = dockerignore_patterns()
    sources = []
    for c in instrs("COPY"):
        if c.args.startswith("--from="):
            continue
        words = exec_or_words(c.args)
        sources += words[:-1]
    assert sources
    for src in sources:
        assert (REPO / src).exists(), f"the Dockerfile copies {src}, which does not exist"
        assert not dockerignored(src, pats), f".dockerignore excludes {src}, which the Dockerfile copies"
        if (REPO / src).is_dir():
            for f in (REPO / src).rglob("*.py"):
                assert not dockerignored(str(f.relative_to(REPO)), pats), f
    for heavy in (".venv/bin/python", ".venv-vllm/lib", ".git/config", "tests/test_deploy.py",
                  "deploy/compose/secrets/pagerduty-routing-key", "exporter/__pycache__/cli.cpython-311.pyc"):
        assert dockerignored(heavy, pats), f".dockerignore lets {heavy} into the build context"


def test_dockerignore_matcher_follows_docker_rules():
    assert dockerignored("a/b.txt", ["*"])
    assert not dockerignored("a/b.txt", ["*", "!a/"])
    assert dockerignored("a/__pycache__/x.pyc", ["*", "!a/", "**/__pycache__"])
    assert not dockerignored("README.md", ["*.txt"])


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_"))}
    return env


@pytest.mark.slow  # a pip install into a fresh environment: a minute quiet, several on a loaded machine
def test_image_build_stage_replayed(tmp_path):
    """Replays the build stage's WORKDIR/COPY/ENV/RUN lines with container paths under a temp root: the
    install command works on the repo, the environment the final stage copies runs `kvwatt`, holds no
    pip, and its entrypoint loads the compose configuration. Reaches PyPI, like scripts/install-deps.sh."""
    build = instrs("FROM")[0].stage
    steps = [i for i in DOCKERFILE if i.stage == build and i.cmd != "FROM"]
    root = tmp_path / "root"
    root.mkdir()
    # the image's `python` is 3.11: use this interpreter's base, outside any venv
    bindir = tmp_path / "bin"
    bindir.mkdir()
    base_python = getattr(sys, "_base_executable", sys.executable)
    (bindir / "python").symlink_to(base_python)
    env = _clean_env()
    env["PATH"] = f"{bindir}:{env.get('PATH', '/usr/bin:/bin')}"
    # container absolute paths that the build stage writes: WORKDIR and the venv
    roots = {i.args.split("/")[1] for i in steps if i.cmd == "WORKDIR"}
    for i in steps:
        for m in re.finditer(r"-m venv (/\S+)", i.args):
            roots.add(m.group(1).split("/")[1])
    root_re = re.compile(r"(?<![\w./-])/(" + "|".join(map(re.escape, sorted(roots))) + r")(?=/|\s|$)")

    def host(path: str, cwd: Path) -> Path:
        return root / path.lstrip("/") if path.startswith("/") else cwd / path

    cwd = root
    for i in steps:
        if i.cmd == "WORKDIR":
            cwd = host(i.args, cwd)
            cwd.mkdir(parents=True, exist_ok=True)
        elif i.cmd == "ENV":
            for k, v in re.findall(r"(\w+)=(\S+)", i.args):
                env[k] = v
        elif i.cmd == "COPY":
            *srcs, dst = exec_or_words(i.args)
            target = host(dst, cwd)
            for s in srcs:
                src = REPO / s
                into = target / src.name if (dst.endswith("/") or len(srcs) > 1) else target
                into.parent.mkdir(parents=True, exist_ok=True)
                if src.is_dir():
                    shutil.copytree(src, into, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy2(src, into)
        elif i.cmd == "RUN":
            cmd = root_re.sub(lambda m: f"{root}/{m.group(1)}", i.args)
            r = subprocess.run(["bash", "-ec", cmd], cwd=cwd, env=env, capture_output=True, text=True,
                               timeout=600)
            assert r.returncode == 0, f"RUN {i.args}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
        elif i.cmd in ("ARG", "LABEL"):
            continue
        else:
            pytest.fail(f"the replay does not know {i.cmd}; extend it rather than skip the step")

    src = next(c.args for c in instrs("COPY", final_stage()) if c.args.startswith("--from=")).split()[1]
    venv = root / src.lstrip("/")
    entry = exec_form(instrs("ENTRYPOINT", final_stage())[-1].args)
    exe = venv / "bin" / entry[0]
    assert exe.exists(), f"the entrypoint {entry[0]} is not in {src}/bin"
    assert not (venv / "bin" / "pip").exists(), "pip is left in the environment the image ships"
    outside = tmp_path / "elsewhere"  # not the repo: the installed package, not the source tree, is imported
    outside.mkdir()
    r = subprocess.run([str(exe), "--version"], cwd=outside, env=_clean_env(), capture_output=True, text=True)
    # an installed package has no git tree: its revision is unknown (exporter/runtime/build.py)
    want = f"kvwatt, version {pyproject_version()} (revision unknown, python {platform.python_version()})"
    assert r.returncode == 0 and r.stdout.strip() == want, r.stdout + r.stderr
    r = subprocess.run([str(exe), "check-config", str(COMPOSE_DIR / "kvwatt.yaml")], cwd=outside,
                       env=_clean_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    # the daemon's runtime dependencies only: neither the lab (lab/, kvwatt_lab) nor its matplotlib, nor the
    # test extra
    for module in ("matplotlib", "kvwatt_lab"):
        r = subprocess.run([str(venv / "bin" / "python"), "-c", f"import {module}"], cwd=outside,
                           env=_clean_env(), capture_output=True, text=True)
        assert r.returncode != 0, f"the daemon's image installs {module} (the lab's, not the daemon's)"
    r = subprocess.run([str(exe), "replay", "x"], cwd=outside, env=_clean_env(), capture_output=True, text=True)
    assert r.returncode == 2 and "part of the kvwatt lab" in r.stderr and "pip install ./lab" in r.stderr, r.stderr
    r = subprocess.run([str(venv / "bin" / "python"), "-c", "import pytest"], cwd=outside,
                       env=_clean_env(), capture_output=True, text=True)
    assert r.returncode != 0, "the image installs the test extra"


def test_entrypoint_imports_without_optional_extras():
    """`kvwatt` builds its parser (importing every command module) with the extras the image lacks blocked."""
    code = ("import sys\n"
            "for m in ('matplotlib', 'requests', 'jsonschema', 'pytest', 'kubernetes_validate'):\n"
            "    sys.modules[m] = None\n"
            "from exporter.cli import build_parser\n"
            "build_parser()\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def run_healthcheck(port: int) -> int:
    argv = healthcheck_argv()
    assert argv[0] == "python"
    env = _clean_env()
    env["KVWATT_LISTEN"] = f"127.0.0.1:{port}"
    return subprocess.run([sys.executable, *argv[1:]], env=env, capture_output=True, timeout=30).returncode


def test_healthcheck_follows_healthz_status():
    """The HEALTHCHECK command: 0 on 200, 1 on 503, 1 when nothing listens."""
    status = {"code": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(status["code"] if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        port = srv.server_address[1]
        assert run_healthcheck(port) == 0
        status["code"] = 503
        assert run_healthcheck(port) == 1
    finally:
        srv.shutdown()
        srv.server_close()
    assert run_healthcheck(free_port()) == 1


def test_healthcheck_against_the_real_daemon(tmp_path):
    """`kvwatt run` as the container runs it (config from compose, env like compose's), probed by the image's
    HEALTHCHECK command. The vLLM URL points at a closed local port; no GPU and no RAPL here."""
    port = free_port()
    env = _clean_env()
    env.update({
        "KVWATT_CONFIG": str(COMPOSE_DIR / "kvwatt.yaml"),
        "KVWATT_LISTEN": f"127.0.0.1:{port}",
        "KVWATT_SERVERS": f"vllm=http://127.0.0.1:{free_port()}",
        "KVWATT_STATE_DIR": str(tmp_path / "state"),
        "KVWATT_POWERCAP_ROOT": str(tmp_path / "no-powercap"),
    })
    proc = subprocess.Popen([sys.executable, "-m", "exporter", "run"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        code = 1
        while time.monotonic() < deadline and proc.poll() is None:
            code = run_healthcheck(port)
            if code == 0:
                break
            time.sleep(0.5)
        assert code == 0, "the image's healthcheck never passed against kvwatt run"
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode is not None, out


# --- compose ----------------------------------------------------------------------------------------------

_VAR_RE = re.compile(r"\$(?:(\$)|\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


def interpolate(value, env: dict[str, str] | None = None):
    """Compose interpolation (${VAR}, ${VAR:-default}, ${VAR-default}, $$) with an empty environment."""
    env = env or {}
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        op, default = m.group(3), m.group(4)
        val = env.get(name)
        if op == ":-":
            return val if val else default
        if op == "-":
            return val if val is not None else default
        if op in (":?", "?"):
            assert val, f"${{{name}}} is required"
            return val
        return val or ""

    return _VAR_RE.sub(sub, value)


RAW_COMPOSE = load_yaml(COMPOSE_FILE)
COMPOSE = interpolate(RAW_COMPOSE)
SERVICES = COMPOSE["services"]


def compose_validator() -> jsonschema.Validator:
    schema = json.loads((DATA / "compose-spec.json").read_text(encoding="utf-8"))
    assert schema["$schema"].startswith("https://json-schema.org/draft-07/")
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def test_compose_file_matches_compose_spec():
    """(b) compose.yaml against the compose-spec JSON schema, as written and after interpolation."""
    v = compose_validator()
    for doc in (RAW_COMPOSE, COMPOSE):
        errors = sorted(v.iter_errors(doc), key=lambda e: list(e.absolute_path))
        assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)


@pytest.mark.parametrize("mutate", [
    lambda d: d["services"]["kvwatt"].__setitem__("helthcheck", {"test": ["NONE"]}),
    lambda d: d["services"]["prometheus"].__setitem__("ports", "9090:9090"),
    lambda d: d["services"]["vllm"]["deploy"]["resources"]["reservations"]["devices"][0].pop("capabilities"),
    lambda d: d.__setitem__("secret", {}),
    lambda d: d["services"]["alertmanager"]["secrets"][0].__setitem__("src", "x"),
], ids=["unknown-key", "ports-not-a-list", "gpu-without-capabilities", "unknown-top-level", "bad-secret-key"])
def test_compose_schema_rejects_broken_files(mutate):
    doc = copy.deepcopy(RAW_COMPOSE)
    mutate(doc)
    assert list(compose_validator().iter_errors(doc)), "the compose-spec schema accepted a broken file"


@dataclass
class Mount:
    type: str  # bind | volume | tmpfs
    source: str
    target: str
    read_only: bool


def mounts(service: dict) -> list[Mount]:
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            out.append(Mount(v["type"], v.get("source", ""), v["target"], bool(v.get("read_only"))))
            continue
        parts = v.split(":")
        src, dst = parts[0], parts[1]
        opts = parts[2].split(",") if len(parts) > 2 else []
        kind = "bind" if src.startswith((".", "/", "~")) else "volume"
        out.append(Mount(kind, src, dst, "ro" in opts))
    return out


def bind_source(m: Mount) -> Path:
    return (COMPOSE_DIR / m.source).resolve() if m.source.startswith(".") else Path(m.source)


def mounted_at(service: str, target: str) -> Mount | None:
    return next((m for m in mounts(SERVICES[service]) if m.target == target), None)


def env_of(service: dict) -> dict[str, str]:
    e = service.get("environment", {})
    if isinstance(e, list):
        e = dict(x.split("=", 1) for x in e)
    return {k: str(v) for k, v in e.items()}


def secret_targets(service: str) -> dict[str, Path]:
    """Container path -> host file of each secret the service gets."""
    out = {}
    for s in SERVICES[service].get("secrets", []):
        name, target = (s, s) if isinstance(s, str) else (s["source"], s.get("target", s["source"]))
        path = target if target.startswith("/") else f"/run/secrets/{target}"
        out[path] = (COMPOSE_DIR / COMPOSE["secrets"][name]["file"]).resolve()
    return out


def published(service: str) -> dict[int, str]:
    """container port -> host address:port of each published port."""
    out = {}
    for p in SERVICES[service].get("ports", []):
        if isinstance(p, dict):
            out[int(p["target"])] = f"{p.get('host_ip', '')}:{p.get('published', '')}"
        else:
            *host, container = str(p).split(":")
            out[int(container.split("/")[0])] = ":".join(host)
    return out


def gpu_reservations(service: dict) -> list[dict]:
    return (service.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", []))


def flag_values(argv: list[str], flag: str) -> list[str]:
    vals = []
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            vals.append(argv[i + 1])
        elif a.startswith(flag + "="):
            vals.append(a.split("=", 1)[1])
    return vals


def test_compose_bind_sources_and_secrets_exist():
    """(d) Every file or directory the stack mounts from the repo exists (alerts/ and dashboards/ included)."""
    missing = []
    for name, svc in SERVICES.items():
        for m in mounts(svc):
            if m.type == "bind" and m.source.startswith("."):
                if not bind_source(m).exists():
                    missing.append(f"{name}: {m.source} -> {m.target}")
        build = svc.get("build")
        if build:
            ctx = (COMPOSE_DIR / (build if isinstance(build, str) else build.get("context", "."))).resolve()
            dockerfile = ctx / ("Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile"))
            if not dockerfile.exists():
                missing.append(f"{name}: build {dockerfile}")
    for name, spec in COMPOSE.get("secrets", {}).items():
        if not (COMPOSE_DIR / spec["file"]).exists():
            missing.append(f"secret {name}: {spec['file']}")
    assert not missing, "mounted paths that do not exist:\n" + "\n".join(missing)
    # named volumes are declared
    declared = set(COMPOSE.get("volumes", {}))
    for name, svc in SERVICES.items():
        for m in mounts(svc):
            if m.type == "volume":
                assert m.source in declared, f"{name}: volume {m.source} is not declared"


def test_compose_vllm_runs_with_kv_offloading_and_mfu_metrics():
    vllm = SERVICES["vllm"]
    assert vllm["image"].split(":")[0] == "vllm/vllm-openai"
    argv = [*vllm.get("entrypoint", []), *vllm.get("command", [])]
    size = flag_values(argv, "--kv-offloading-size")
    assert size and float(size[0]) > 0, "KV offloading needs --kv-offloading-size GiB"
    assert flag_values(argv, "--kv-offloading-backend") == ["native"]
    assert "--enable-mfu-metrics" in argv
    gpus = gpu_reservations(vllm)
    assert gpus and gpus[0]["driver"] == "nvidia" and "gpu" in gpus[0]["capabilities"]


def test_compose_kvwatt_service_has_what_each_source_needs():
    kv = SERVICES["kvwatt"]
    env = env_of(kv)
    build = kv["build"]
    assert (COMPOSE_DIR / build["context"]).resolve() == REPO and build["dockerfile"] == "Dockerfile"
    # NVML: an NVIDIA device request (or the nvidia runtime) with the utility capability
    gpus = gpu_reservations(kv)
    assert (gpus and gpus[0]["driver"] == "nvidia" and "utility" in gpus[0]["capabilities"]) \
        or kv.get("runtime") == "nvidia"
    assert "utility" in env.get("NVIDIA_DRIVER_CAPABILITIES", "").split(",")
    # RAPL: a read-only bind of the host's sysfs, and the powercap root inside it
    root = env["KVWATT_POWERCAP_ROOT"]
    sysfs = [m for m in mounts(kv) if m.type == "bind" and m.source == "/sys"]
    assert sysfs and sysfs[0].read_only, "the host's /sys must be bound read-only"
    assert root == sysfs[0].target.rstrip("/") + "/class/powercap", root
    # config: KVWATT_CONFIG is a read-only bind of deploy/compose/kvwatt.yaml
    cfg = mounted_at("kvwatt", env["KVWATT_CONFIG"])
    assert cfg and cfg.read_only and bind_source(cfg) == COMPOSE_DIR / "kvwatt.yaml"
    # state: a named volume on the image's state directory
    state = mounted_at("kvwatt", "/var/lib/kvwatt")
    assert state and state.type == "volume"
    # non-root by default: the image's user
    assert kv.get("user", ":".join(dockerfile_user())) == ":".join(dockerfile_user())
    assert kv.get("read_only") is True and "ALL" in kv.get("cap_drop", [])


def compose_kvwatt_config():
    from exporter.config import load_file
    return load_file(str(COMPOSE_DIR / "kvwatt.yaml"))


def test_compose_ports_agree():
    """(d) kvwatt on 8492 in the Dockerfile, the config, compose and prometheus.yml; vLLM on one port."""
    cfg = compose_kvwatt_config()
    assert cfg.port == KVWATT_PORT
    assert KVWATT_PORT in published("kvwatt")
    prom = load_yaml(COMPOSE_DIR / "prometheus.yml")
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    targets = {t for sc in jobs["kvwatt"]["static_configs"] for t in sc["targets"]}
    assert targets == {f"kvwatt:{KVWATT_PORT}"}
    # vLLM: the port it serves on == the published one == the scrape target == kvwatt's server URL
    argv = [*SERVICES["vllm"].get("entrypoint", []), *SERVICES["vllm"]["command"]]
    vport = int(flag_values(argv, "--port")[0])
    assert vport in published("vllm")
    assert {t for sc in jobs["vllm"]["static_configs"] for t in sc["targets"]} == {f"vllm:{vport}"}
    assert [s.url for s in cfg.servers] == [f"http://vllm:{vport}"]
    # every scrape/alerting target is a service of the stack (or Prometheus itself)
    for job in prom["scrape_configs"]:
        for sc in job.get("static_configs", []):
            for t in sc["targets"]:
                hostname = t.rsplit(":", 1)[0]
                assert hostname in SERVICES or hostname == "localhost", t
    am = [t for a in prom["alerting"]["alertmanagers"] for sc in a["static_configs"] for t in sc["targets"]]
    assert am == ["alertmanager:9093"] and 9093 in published("alertmanager")
    assert 9090 in published("prometheus") and 3000 in published("grafana")


def test_compose_labels_let_the_rules_join_kvwatt_and_vllm():
    """alerts/kvwatt-rules.yaml joins vLLM and kvwatt series on `node` and sums vLLM series by `server`:
    the vLLM target carries the server name kvwatt.yaml gives it, and both share a node label."""
    prom = load_yaml(COMPOSE_DIR / "prometheus.yml")
    labels = {j["job_name"]: j["static_configs"][0].get("labels", {}) for j in prom["scrape_configs"]}
    assert labels["kvwatt"].get("node") and labels["kvwatt"]["node"] == labels["vllm"].get("node")
    assert "server" not in labels["kvwatt"], "kvwatt's own series carry server; a target label would clash"
    assert labels["vllm"].get("server") in {s.name for s in compose_kvwatt_config().servers}
    rules = (ALERTS / "kvwatt-rules.yaml").read_text(encoding="utf-8")
    for label in ("server", "node"):
        assert re.search(rf"\b(by|on) \([^)]*\b{label}\b", rules), f"the rules no longer use {label}; revisit"


def test_compose_grafana_provisioning_matches_dashboards():
    """(d) Grafana gets the datasource and provider files at the paths Grafana reads, every dashboard JSON at
    the provider's path, and the datasource URL names the stack's Prometheus."""
    g = mounts(SERVICES["grafana"])
    by_source = {bind_source(m): m for m in g if m.type == "bind"}
    ds_file = DASHBOARDS / "provisioning" / "datasource.yaml"
    prov_file = DASHBOARDS / "provisioning" / "dashboards.yaml"
    assert ds_file in by_source and prov_file in by_source
    assert re.fullmatch(r"/etc/grafana/provisioning/datasources/[^/]+\.ya?ml", by_source[ds_file].target)
    assert re.fullmatch(r"/etc/grafana/provisioning/dashboards/[^/]+\.ya?ml", by_source[prov_file].target)
    providers = load_yaml(prov_file)["providers"]
    paths = {p["options"]["path"].rstrip("/") for p in providers}
    jsons = sorted(DASHBOARDS.glob("*.json"))
    assert jsons
    for j in jsons:
        m = by_source.get(j)
        assert m, f"{j.name} is not mounted into Grafana"
        assert str(Path(m.target).parent) in paths, f"{j.name} mounted outside the provider path {paths}"
    home = env_of(SERVICES["grafana"]).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert home in {m.target for m in g}, home
    for ds in load_yaml(ds_file)["datasources"]:
        if ds["type"] == "prometheus":
            host, port = re.match(r"https?://([^:/]+):(\d+)", ds["url"]).groups()
            assert host in SERVICES and int(port) in published(host), ds["url"]


def mirror(service: str, dest: Path) -> Path:
    """Lay out the service's bind mounts and secrets under dest as the container sees them."""
    for m in mounts(SERVICES[service]):
        if m.type != "bind":
            continue
        src = bind_source(m)
        target = dest / m.target.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, target, dirs_exist_ok=True)
        elif src.exists():
            shutil.copy(src, target)
    for path, src in secret_targets(service).items():
        target = dest / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.exists():
            shutil.copy(src, target)
    return dest


def config_flag(service: str, flag: str = "--config.file") -> str:
    vals = flag_values(SERVICES[service].get("command", []), flag)
    assert vals, f"{service} must name its {flag}"
    return vals[0]


def prometheus_mirror_problems(dest: Path) -> list[str]:
    """What promtool alone does not catch: a rule_files entry that matches no file is silently skipped."""
    cfg_path = dest / config_flag("prometheus").lstrip("/")
    if not cfg_path.exists():
        return [f"{config_flag('prometheus')} is not mounted"]
    cfg = load_yaml(cfg_path)
    problems = []
    for rf in cfg.get("rule_files", []):
        if rf.startswith("/"):
            problems.append(f"rule file {rf} is absolute: keep it relative to the config so the test resolves it")
        elif not list(cfg_path.parent.glob(rf)):
            problems.append(f"rule file {rf} matches nothing where the container has files ({cfg_path.parent})")
    return problems


@pytest.mark.prom
def test_prometheus_config_loads_in_promtool(tmp_path):
    """(e) The stack's prometheus.yml and the rule files it names, at the container's paths, in promtool."""
    promtool = tool("promtool")
    dest = mirror("prometheus", tmp_path)
    assert not prometheus_mirror_problems(dest), prometheus_mirror_problems(dest)
    cfg = dest / config_flag("prometheus").lstrip("/")
    r = subprocess.run([promtool, "check", "config", str(cfg)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    found = re.findall(r"SUCCESS: (\d+) rules found", r.stdout + r.stderr)
    assert found and all(int(n) > 0 for n in found), r.stdout + r.stderr
    assert len(found) == len(load_yaml(cfg)["rule_files"])


@pytest.mark.prom
def test_promtool_check_catches_a_missing_rules_mount(tmp_path):
    saved = SERVICES["prometheus"]["volumes"]
    SERVICES["prometheus"]["volumes"] = [v for v in saved if "kvwatt-rules" not in str(v)]
    try:
        dest = mirror("prometheus", tmp_path)
    finally:
        SERVICES["prometheus"]["volumes"] = saved
    assert prometheus_mirror_problems(dest), "a Prometheus without its rule file passed"


def file_refs(node, key_path: str = "") -> list[tuple[str, str]]:
    """(key path, value) of every *_file setting in an Alertmanager config."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, str) and k.endswith("_file"):
                out.append((f"{key_path}.{k}", v))
            else:
                out += file_refs(v, f"{key_path}.{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += file_refs(v, f"{key_path}[{i}]")
    return out


@pytest.mark.prom
def test_alertmanager_config_loads_in_amtool(tmp_path):
    """(e) alerts/alertmanager.yml as the container sees it, in amtool; the PagerDuty key comes from a file
    (routing_key_file) that the stack provides as a compose secret."""
    amtool = tool("amtool")
    dest = mirror("alertmanager", tmp_path)
    cfg_path = dest / config_flag("alertmanager").lstrip("/")
    assert cfg_path.exists(), "alertmanager's --config.file is not mounted"
    cfg = load_yaml(cfg_path)
    pd = [pc for r in cfg.get("receivers", []) for pc in r.get("pagerduty_configs", [])]
    assert pd, "the stack's Alertmanager has no PagerDuty receiver"
    for pc in pd:
        assert "routing_key_file" in pc and "routing_key" not in pc, "the key must come from a file"
    refs = file_refs(cfg)
    assert refs
    for key, path in refs:
        full = dest / path.lstrip("/") if path.startswith("/") else cfg_path.parent / path
        assert full.exists(), f"{key} = {path} is not provided to the alertmanager container (mount or secret)"
    for tmpl in cfg.get("templates", []):
        pattern = tmpl.lstrip("/") if tmpl.startswith("/") else str((cfg_path.parent / tmpl).relative_to(dest))
        assert list(dest.glob(pattern)), f"template {tmpl} is not mounted"
    r = subprocess.run([amtool, "check-config", str(cfg_path)], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr


# --- Kubernetes -------------------------------------------------------------------------------------------

KUSTOMIZATION = load_yaml(K8S_DIR / "kustomization.yaml")


def k8s_docs() -> list[tuple[str, dict]]:
    out = []
    for name in KUSTOMIZATION["resources"]:
        for doc in load_yaml_all(K8S_DIR / name):
            out.append((name, doc))
    return out


def k8s_find(kind: str, name: str | None = None) -> dict:
    hits = [d for _, d in k8s_docs() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def test_kustomization_lists_every_manifest():
    files = {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(KUSTOMIZATION["resources"]) == files, "kustomization.yaml and the directory disagree"
    assert len(KUSTOMIZATION["resources"]) == len(set(KUSTOMIZATION["resources"]))
    assert KUSTOMIZATION.get("namespace")
    # only the kustomize features the tests model: resources, namespace, images
    assert set(KUSTOMIZATION) <= {"apiVersion", "kind", "namespace", "resources", "images"}, set(KUSTOMIZATION)
    # the image tag is the package's version
    (img,) = KUSTOMIZATION["images"]
    assert img["newTag"] == pyproject_version()
    ds = k8s_find("DaemonSet")
    image = ds["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.split(":")[0] == img["name"] and image.split(":")[1] == pyproject_version()


def crd_validator(kind: str) -> jsonschema.Validator:
    schema = json.loads((DATA / "prometheus-operator" / f"{kind.lower()}-v1.json").read_text(encoding="utf-8"))
    schema.pop("x-source")
    # The API server drops unknown fields and `kubectl apply` (strict field validation, the default since
    # 1.27) rejects them: model that by closing every object that lists its properties.
    def close(node):
        if isinstance(node, dict):
            if (node.get("type") == "object" and "properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for v in node.values():
                close(v)
        elif isinstance(node, list):
            for v in node:
                close(v)
    close(schema)
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


def validate_manifest(doc: dict) -> list[str]:
    """Schema errors of one manifest: kubernetes-validate (strict) for built-in kinds, the vendored Prometheus
    Operator CRD schema for monitoring.coreos.com kinds."""
    import kubernetes_validate
    if doc["apiVersion"].startswith("monitoring.coreos.com/"):
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        errors = [f"{list(e.absolute_path)}: {e.message}" for e in crd_validator(doc["kind"]).iter_errors(doc)]
        md = doc.get("metadata", {})
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", md.get("name", "")):
            errors.append(f"metadata.name {md.get('name')!r} is not a DNS-1123 name")
        for k, v in {**md.get("labels", {}), **md.get("annotations", {})}.items():
            if not isinstance(v, str):
                errors.append(f"metadata label/annotation {k} is not a string")
        if set(md) - {"name", "namespace", "labels", "annotations"}:
            errors.append(f"unexpected metadata fields {set(md)}")
        return errors
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        return [f"{list(e.absolute_path)}: {e.message}"]
    return []


def _manifest_ids() -> list[tuple[str, int]]:
    out = []
    for n in KUSTOMIZATION["resources"]:
        count = len(load_yaml_all(K8S_DIR / n)) if (K8S_DIR / n).exists() else 1
        out += [(n, i) for i in range(count)]
    return out


@pytest.mark.parametrize("name,index", _manifest_ids())
def test_kubernetes_manifests_match_their_schemas(name, index):
    """(c) Built-in kinds against Kubernetes 1.37's OpenAPI schemas (kubernetes-validate, bundled, strict);
    ServiceMonitor and PrometheusRule against the Prometheus Operator's CRD schemas (vendored)."""
    assert (K8S_DIR / name).exists(), f"{name} is missing: run deploy/kubernetes/generate.py"
    doc = load_yaml_all(K8S_DIR / name)[index]
    errors = validate_manifest(doc)
    assert not errors, f"{name}[{index}] {doc['kind']}/{doc['metadata'].get('name')}:\n" + "\n".join(errors)


K8S_MUTATIONS = [
    ("DaemonSet", lambda d: d["spec"]["template"]["spec"].__setitem__("hostNetwork", "yes")),
    ("DaemonSet", lambda d: d["spec"]["template"]["spec"]["containers"][0].__setitem__("livenesProbe", {})),
    ("DaemonSet", lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].__setitem__(
        "containerPort", "8492")),
    ("Service", lambda d: d["spec"]["ports"][0].__setitem__("port", "metrics")),
    ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].__setitem__("intervall", "15s")),
    ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].__setitem__("interval", "15 seconds")),
    ("PrometheusRule", lambda d: d["spec"]["groups"][0].__setitem__("rules", "none")),
    ("PrometheusRule", lambda d: d["spec"]["groups"][0].pop("name")),
]


@pytest.mark.parametrize("kind,mutate", K8S_MUTATIONS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(K8S_MUTATIONS)])
def test_kubernetes_validation_rejects_broken_manifests(kind, mutate):
    doc = copy.deepcopy(next(d for _, d in k8s_docs() if d["kind"] == kind))
    mutate(doc)
    assert validate_manifest(doc), f"a broken {kind} passed validation"


def container() -> dict:
    return k8s_find("DaemonSet")["spec"]["template"]["spec"]["containers"][0]


def k8s_env() -> dict[str, dict]:
    return {e["name"]: e for e in container()["env"]}


def test_daemonset_runs_on_gpu_nodes_with_nvml_and_rapl():
    ds = k8s_find("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    c = container()
    env = k8s_env()
    # GPU nodes: selector and the GPU taint; NVML through the NVIDIA runtime, without taking a GPU
    assert any(k.startswith("nvidia.com/gpu") for k in pod["nodeSelector"])
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod["tolerations"])
    assert pod.get("runtimeClassName") == "nvidia" or env.get("NVIDIA_VISIBLE_DEVICES")
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"]["value"].split(",")
    res = c["resources"]
    assert not any("nvidia.com/gpu" in k for part in res.values() for k in part), "must not consume a GPU"
    assert res["requests"]["cpu"] and res["requests"]["memory"] and res["limits"]["memory"]
    # RAPL: the host's /sys read-only, powercap root inside it (same layout as compose)
    vols = {v["name"]: v for v in pod["volumes"]}
    vm = {m["name"]: m for m in c["volumeMounts"]}
    host_sys = [n for n, v in vols.items() if v.get("hostPath", {}).get("path") == "/sys"]
    assert host_sys and vm[host_sys[0]].get("readOnly") is True
    assert env["KVWATT_POWERCAP_ROOT"]["value"] == vm[host_sys[0]]["mountPath"].rstrip("/") + "/class/powercap"
    assert env["KVWATT_POWERCAP_ROOT"]["value"] == env_of(SERVICES["kvwatt"])["KVWATT_POWERCAP_ROOT"]
    # config from the ConfigMap, state on a writable volume
    cfg_dir = str(Path(env["KVWATT_CONFIG"]["value"]).parent)
    cfg_mount = next(m for m in c["volumeMounts"] if m["mountPath"] == cfg_dir)
    cm_name = vols[cfg_mount["name"]]["configMap"]["name"]
    assert Path(env["KVWATT_CONFIG"]["value"]).name in k8s_find("ConfigMap", cm_name)["data"]
    state = next(m for m in c["volumeMounts"] if m["mountPath"] == env["KVWATT_STATE_DIR"]["value"])
    assert not state.get("readOnly")
    # security: the image's non-root user, nothing more
    uid, gid = dockerfile_user()
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True and str(sc["runAsUser"]) == uid and str(sc["runAsGroup"]) == gid
    csc = c["securityContext"]
    assert csc["allowPrivilegeEscalation"] is False and csc["readOnlyRootFilesystem"] is True
    assert csc["capabilities"]["drop"] == ["ALL"]
    assert pod.get("automountServiceAccountToken") is False
    # probes on /healthz through the metrics port
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["path"] == "/healthz"
        assert c[probe]["httpGet"]["port"] in ("metrics", KVWATT_PORT)


def test_kubernetes_ports_and_selectors_agree():
    """(d) 8492 in the container, the Service and the config; the Service selects the DaemonSet's pods; the
    ServiceMonitor selects the Service and scrapes its port by name; job = "kvwatt"."""
    ds = k8s_find("DaemonSet")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    (port,) = container()["ports"]
    assert port["containerPort"] == KVWATT_PORT
    svc = k8s_find("Service", "kvwatt")
    assert all(pod_labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert all(pod_labels.get(k) == v for k, v in ds["spec"]["selector"]["matchLabels"].items())
    (sport,) = svc["spec"]["ports"]
    assert sport["port"] == KVWATT_PORT and sport["targetPort"] in (port["name"], KVWATT_PORT)
    sm = k8s_find("ServiceMonitor", "kvwatt")
    sel = sm["spec"]["selector"]["matchLabels"]
    assert all(svc["metadata"]["labels"].get(k) == v for k, v in sel.items())
    (ep,) = sm["spec"]["endpoints"]
    assert ep["port"] == sport["name"] and ep.get("path", "/metrics") == "/metrics"
    assert ep.get("honorLabels", False) is False
    assert svc["metadata"]["labels"][sm["spec"]["jobLabel"]] == "kvwatt"
    # the config's listen port
    from exporter.config import from_mapping
    cm = k8s_find("ConfigMap", "kvwatt-config")
    assert from_mapping(yaml.safe_load(cm["data"]["kvwatt.yaml"])).port == KVWATT_PORT
    # the vLLM ServiceMonitor scrapes /metrics of Services labelled for vLLM
    vsm = k8s_find("ServiceMonitor", "vllm")
    assert vsm["spec"]["selector"]["matchLabels"] and vsm["spec"]["endpoints"][0]["path"] == "/metrics"


def relabel_targets(sm: dict) -> dict[str, list[str]]:
    return {r["targetLabel"]: r["sourceLabels"] for ep in sm["spec"]["endpoints"]
            for r in ep.get("relabelings", []) if r.get("action", "replace") == "replace"}


def test_kubernetes_labels_let_the_rules_join_kvwatt_and_vllm():
    """Both ServiceMonitors add `node`; vLLM's `server` is the node name, which is the server name the
    DaemonSet gives kvwatt (KVWATT_SERVERS), so `server` joins kvwatt and vLLM series and is unique per
    cluster."""
    node_src = ["__meta_kubernetes_pod_node_name"]
    kv = relabel_targets(k8s_find("ServiceMonitor", "kvwatt"))
    vl = relabel_targets(k8s_find("ServiceMonitor", "vllm"))
    assert kv.get("node") == node_src and vl.get("node") == node_src
    assert vl.get("server") == node_src and "server" not in kv
    env = k8s_env()
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["KVWATT_SERVERS"]["value"].split("=", 1)[0] == "$(NODE_NAME)"
    # the env var chain resolves to a valid configuration (Kubernetes expands $(VAR) of earlier variables)
    from exporter.config import resolve
    expanded = {"NODE_NAME": "gpu-node-7.example", "HOST_IP": "10.0.0.7"}
    servers = re.sub(r"\$\((\w+)\)", lambda m: expanded[m.group(1)], env["KVWATT_SERVERS"]["value"])
    names = [e["name"] for e in container()["env"]]
    assert names.index("NODE_NAME") < names.index("KVWATT_SERVERS") and names.index("HOST_IP") < names.index(
        "KVWATT_SERVERS"), "$(VAR) only expands variables defined earlier"
    cfg = resolve(None, env={"KVWATT_SERVERS": servers})
    assert [(s.name, s.url) for s in cfg.servers] == [("gpu-node-7.example", "http://10.0.0.7:8000")]


def rule_job_matchers(text: str) -> list[tuple[str, str]]:
    return re.findall(r'\bjob\s*(=~|=)\s*"([^"]*)"', text)


def test_rule_job_selectors_match_the_scrape_jobs():
    """Alerts select kvwatt by job (e.g. job=~"kvwatt.*"): the compose and Kubernetes jobs must match."""
    rules = (ALERTS / "kvwatt-rules.yaml").read_text(encoding="utf-8")
    matchers = rule_job_matchers(rules)
    assert matchers, "no job matcher in the rules: the test has nothing to check"
    compose_jobs = {j["job_name"] for j in load_yaml(COMPOSE_DIR / "prometheus.yml")["scrape_configs"]}
    k8s_jobs = {"kvwatt", "vllm"}  # jobLabel app.kubernetes.io/name of each Service (checked above)
    for jobs in (compose_jobs, k8s_jobs):
        for op, value in matchers:
            ok = any(re.fullmatch(value, j) for j in jobs) if op == "=~" else value in jobs
            assert ok, f'job{op}"{value}" matches none of {sorted(jobs)}'


def test_prometheusrule_is_the_one_from_alerts():
    """(d) deploy/kubernetes/prometheusrule.yaml equals alerts/kvwatt-prometheusrule.yaml, and its groups are
    those of alerts/kvwatt-rules.yaml that compose's Prometheus loads."""
    source = load_yaml(ALERTS / "kvwatt-prometheusrule.yaml")
    deployed = load_yaml(K8S_DIR / "prometheusrule.yaml")
    assert deployed == source
    assert deployed["spec"] == load_yaml(ALERTS / "kvwatt-rules.yaml")


def test_dashboard_configmaps_are_the_dashboards():
    """(d) One ConfigMap per dashboards/*.json, labelled for the sidecar, holding the JSON unchanged."""
    maps = [d for d in load_yaml_all(K8S_DIR / "grafana-dashboards.yaml")]
    by_key = {}
    for cm in maps:
        assert cm["kind"] == "ConfigMap"
        assert cm["metadata"]["labels"].get("grafana_dashboard") == "1"
        for key, text in cm["data"].items():
            by_key[key] = text
        # client-side `kubectl apply` keeps the object in a 256 KiB annotation
        assert len(yaml.safe_dump(cm).encode()) < 256 * 1024, cm["metadata"]["name"]
    files = {p.name: p.read_text(encoding="utf-8") for p in DASHBOARDS.glob("*.json")}
    assert files and set(by_key) == set(files)
    for name, text in files.items():
        assert by_key[name] == text, f"{name} differs from its ConfigMap"
        assert json.loads(by_key[name])["uid"]


def test_kubernetes_generator_is_current():
    r = subprocess.run([sys.executable, str(K8S_DIR / "generate.py"), "--check"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_kubernetes_generator_check_fails_when_stale(tmp_path, monkeypatch):
    import importlib.util
    spec = importlib.util.spec_from_file_location("kvwatt_k8s_generate", K8S_DIR / "generate.py")
    k8s_generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(k8s_generate)
    stale = tmp_path / "prometheusrule.yaml"
    stale.write_text((K8S_DIR / "prometheusrule.yaml").read_text(encoding="utf-8").replace("for:", "for: 1m #"))
    monkeypatch.setattr(k8s_generate, "RULE_OUT", stale)
    monkeypatch.setattr(k8s_generate, "REPO", tmp_path.parent)
    monkeypatch.setattr(k8s_generate, "DASHBOARDS_OUT", tmp_path / "grafana-dashboards.yaml")
    (tmp_path / "grafana-dashboards.yaml").write_text(k8s_generate.dashboards_manifest())
    assert k8s_generate.main(["--check"]) == 1
    (tmp_path / "prometheusrule.yaml").write_text(k8s_generate.rule_manifest())
    assert k8s_generate.main(["--check"]) == 0


# --- kvwatt configuration in both deployments -------------------------------------------------------------

def k8s_config_text() -> str:
    return k8s_find("ConfigMap", "kvwatt-config")["data"]["kvwatt.yaml"]


def check_config(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter", "check-config", str(path)], cwd=REPO,
                          capture_output=True, text=True)


@pytest.mark.parametrize("where", ["compose", "kubernetes"])
def test_kvwatt_configs_pass_check_config(where, tmp_path):
    """(d) `kvwatt check-config` accepts the configuration each deployment mounts; a broken copy exits 2."""
    if where == "compose":
        path = COMPOSE_DIR / "kvwatt.yaml"
    else:
        path = tmp_path / "kvwatt.yaml"
        path.write_text(k8s_config_text(), encoding="utf-8")
    r = check_config(path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"listen 0.0.0.0:{KVWATT_PORT}" in r.stdout
    broken = tmp_path / "broken.yaml"
    broken.write_text(path.read_text(encoding="utf-8") + "\nwindowz: [1m]\n", encoding="utf-8")
    r = check_config(broken)
    assert r.returncode == 2 and "windowz" in r.stderr, r.stdout + r.stderr


def test_powercap_root_is_not_overridden_by_the_config_files():
    """The containers set KVWATT_POWERCAP_ROOT from their mounts; a file setting another root would be
    overridden by the environment and mislead readers."""
    for text in ((COMPOSE_DIR / "kvwatt.yaml").read_text(encoding="utf-8"), k8s_config_text()):
        root = (yaml.safe_load(text) or {}).get("powercap_root")
        assert root in (None, "/host/sys/class/powercap"), root


@pytest.mark.parametrize("where", ["compose", "kubernetes"])
def test_rapl_is_found_through_the_deployed_mount(where, tmp_path):
    """The mount layout the deployments use (host /sys read-only, root at <mount>/class/powercap) gives the
    RAPL reader the host's zones; a bind of /sys/class/powercap alone would leave dangling symlinks."""
    from exporter.sources.rapl import discover
    from tests.support.powercap import intel_two_socket
    host = tmp_path / "host"
    intel_two_socket(host)  # host/sys/class/powercap -> ../../devices/virtual/powercap/...
    if where == "compose":
        root = env_of(SERVICES["kvwatt"])["KVWATT_POWERCAP_ROOT"]
        (mount,) = [m for m in mounts(SERVICES["kvwatt"]) if m.source == "/sys"]
        source, target = mount.source, mount.target
    else:
        root = k8s_env()["KVWATT_POWERCAP_ROOT"]["value"]
        pod = k8s_find("DaemonSet")["spec"]["template"]["spec"]
        vols = {v["name"]: v for v in pod["volumes"]}
        (m,) = [m for m in container()["volumeMounts"] if vols[m["name"]].get("hostPath", {}).get("path") == "/sys"]
        source, target = "/sys", m["mountPath"]
    container_root = tmp_path / "container"
    # the container's view: the host's source directory appears at target
    (container_root / target.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    (container_root / target.lstrip("/")).symlink_to(host / source.lstrip("/"), target_is_directory=True)
    zones, reason = discover(str(container_root / root.lstrip("/")))
    assert {(z.zone, z.domain) for z in zones} >= {("package-0", "package"), ("package-1", "package")}, reason
    # the alternative the docs warn about: only the class directory, copied with its relative symlinks
    alone = tmp_path / "alone" / "host" / "powercap"
    shutil.copytree(host / "sys" / "class" / "powercap", alone, symlinks=True)
    zones, reason = discover(str(alone))
    assert not zones and reason.startswith("masked"), reason


# --- fleet rules ------------------------------------------------------------------------------------------

def recorded_names(path: Path) -> set[str]:
    return {r["record"] for g in load_yaml(path)["groups"] for r in g["rules"] if "record" in r}


@pytest.mark.prom
def test_fleet_rules_load_and_aggregate(tmp_path):
    promtool = tool("promtool")
    rules = FLEET_DIR / "kvwatt-fleet-rules.yaml"
    r = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([promtool, "test", "rules", "kvwatt-fleet-rules.test.yaml"], cwd=FLEET_DIR,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.prom
def test_federation_example_loads_and_ships_the_fleet_rules_inputs():
    """deploy/fleet/prometheus-federation.yml loads in promtool (with the fleet rules), federates with
    honor_labels, and its match[] selects every per-cluster series the fleet rules read."""
    promtool = tool("promtool")
    path = FLEET_DIR / "prometheus-federation.yml"
    r = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"SUCCESS: [1-9]\d* rules found", r.stdout + r.stderr), r.stdout + r.stderr
    cfg = load_yaml(path)
    (job,) = [j for j in cfg["scrape_configs"] if j.get("metrics_path") == "/federate"]
    assert job["honor_labels"] is True
    regexes = [re.search(r'__name__=~"([^"]+)"', m).group(1) for m in job["params"]["match[]"]]
    own = recorded_names(FLEET_DIR / "kvwatt-fleet-rules.yaml")
    fleet = load_yaml(FLEET_DIR / "kvwatt-fleet-rules.yaml")
    inputs = {n for g in fleet["groups"] for rule in g["rules"]
              for n in re.findall(r"\b([a-z_]*:[a-z0-9_]+:[a-z0-9_]+)\b", rule["expr"])} - own
    assert inputs
    for name in inputs:
        assert any(re.fullmatch(rx, name) for rx in regexes), f"federation does not ship {name}"
    # and no raw per-node series
    for raw in ("kvwatt_gpu_energy_joules_total", "vllm:generation_tokens_total"):
        assert not any(re.fullmatch(rx, raw) for rx in regexes), raw


def test_fleet_rules_read_what_the_cluster_rules_record():
    """Every recorded series the global rules read is recorded per cluster by alerts/kvwatt-rules.yaml."""
    fleet = load_yaml(FLEET_DIR / "kvwatt-fleet-rules.yaml")
    own = recorded_names(FLEET_DIR / "kvwatt-fleet-rules.yaml")
    cluster = recorded_names(ALERTS / "kvwatt-rules.yaml")
    for g in fleet["groups"]:
        for rule in g["rules"]:
            for name in re.findall(r"\b([a-z_]*:[a-z0-9_]+:[a-z0-9_]+)\b", rule["expr"]):
                assert name in own or name in cluster, f"{rule['record']} reads {name}, which nobody records"
            # cluster level (per cluster) or fleet level (all clusters): names the federation never ships back
            assert rule["record"].startswith(("cluster", "fleet")), rule["record"]
            assert rule["record"] not in cluster, f"{rule['record']} is also a per-cluster name"


# --- docs -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("doc", ["docs/deployment.md", "docs/fleet.md"])
def test_deployment_docs_links_resolve(doc):
    text = (REPO / doc).read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" in target:
            continue
        assert ((REPO / doc).parent / target).resolve().exists(), f"{doc} links to missing {target}"
    if doc == "docs/deployment.md":
        assert "docker compose -f deploy/compose/compose.yaml up -d" in text
        assert "kubectl apply -k deploy/kubernetes" in text
