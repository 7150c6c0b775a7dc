# syntax=docker/dockerfile:1
# kvwatt: Prometheus exporter for vLLM servers with KV offloading (docs/deployment.md).
#
#   docker build -t kvwatt:local .
#   docker run -d --gpus all -p 8492:8492 \
#     -v /sys:/host/sys:ro -e KVWATT_POWERCAP_ROOT=/host/sys/class/powercap \
#     -e KVWATT_SERVERS=vllm=http://HOST:8000 kvwatt:local
#
# Two stages: the build stage creates a virtual environment in /opt/kvwatt and installs kvwatt into it with
# scripts/install-kvwatt.sh, the same script and pip command the test suite runs (scripts/install-deps.sh;
# tests/test_deploy.py compares them). The final stage copies only that environment: no compilers, headers,
# pip caches or source tree. Both stages use the same base image, so the venv's interpreter path is valid.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/kvwatt
COPY pyproject.toml README.md ./
COPY scripts/install-kvwatt.sh scripts/install-kvwatt.sh
COPY exporter exporter
RUN scripts/install-kvwatt.sh /opt/kvwatt/bin/pip .
# kvwatt never installs anything at run time: drop the installers from the environment that ships.
RUN /opt/kvwatt/bin/python -m pip uninstall -y -q pip setuptools wheel \
    && /opt/kvwatt/bin/kvwatt --version

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvwatt" \
      org.opencontainers.image.description="Prometheus exporter: KV-cache pressure, recomputation and energy per token of vLLM servers with KV offloading" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed, unprivileged uid/gid (10001) so hosts can grant it access (udev rule for RAPL, volume ownership).
RUN groupadd --system --gid 10001 kvwatt \
    && useradd --system --uid 10001 --gid kvwatt --home-dir /var/lib/kvwatt --no-create-home \
       --shell /usr/sbin/nologin kvwatt \
    && mkdir -p /var/lib/kvwatt /etc/kvwatt \
    && chown kvwatt:kvwatt /var/lib/kvwatt
COPY --from=build /opt/kvwatt /opt/kvwatt
ENV PATH=/opt/kvwatt/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVWATT_STATE_DIR=/var/lib/kvwatt \
    NVIDIA_DRIVER_CAPABILITIES=utility
# NVML needs the NVIDIA container runtime to inject libnvidia-ml and the device nodes: `--gpus all` (or
# `runtime: nvidia` with NVIDIA_VISIBLE_DEVICES=all). The `utility` capability is all NVML needs.
USER 10001:10001
WORKDIR /var/lib/kvwatt
# Idle baselines and recorded OFF profiles persist here across restarts.
VOLUME ["/var/lib/kvwatt"]
EXPOSE 8492
# No curl in the slim image: Python's urllib probes /healthz on the port of KVWATT_LISTEN (default 8492).
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os,sys,urllib.request as u; p=os.environ.get('KVWATT_LISTEN','0.0.0.0:8492').rsplit(':',1)[1]; sys.exit(0 if u.urlopen('http://127.0.0.1:'+p+'/healthz',timeout=4).status==200 else 1)"]
ENTRYPOINT ["kvwatt", "run"]
