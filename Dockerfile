# One image for three roles:
#   server (default):  docker run -p 7070:7070 -v sos-data:/data -v "$PWD/tls:/tls:ro" IMAGE
#                      (TLS: /tls/tls.crt and /tls/tls.key, made as docs/DEPLOY.md shows)
#   gateway:           docker run --read-only --tmpfs /tmp --cap-drop ALL \
#                        --security-opt no-new-privileges -v gw-cache:/cache -e SOS_KEY ... IMAGE \
#                        sos gateway NAMESPACE --listen 0.0.0.0:9870 --advertise HOST:9870 \
#                        --cache /cache/NAMESPACE \
#                        --tls-ca /tls/server/tls.crt --tls-cert ... --tls-key ...
#                      (unprivileged, uid 10001, read-only root: it writes only in --cache)
#   mount sidecar:     docker run --device /dev/fuse --cap-add SYS_ADMIN IMAGE \
#                        sos mount NAMESPACE /mnt/sos --cache /cache --tls-ca /tls/tls.crt
# See docs/DEPLOY.md.
#
# No `# syntax=` line: it makes BuildKit pull a frontend image from Docker Hub, so an offline
# build fails. The base comes from PYTHON_IMAGE (a registry's python:3.11-slim-bookworm by
# default; without a registry, a stand-in made from Debian's packages:
# `python -m tools.container build`, docs/DEPLOY.md). Build with podman as
# `podman build --format docker ...`: in its default OCI format podman drops HEALTHCHECK.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- requirements: the dependencies' list, read from pyproject.toml. The build stage COPYs the
# list alone: podman and docker reuse a COPY's layer while the file's content is the same, so the
# dependencies' wheels below are built again only when the list changes, not at every change to
# the sources or to pyproject.toml's other tables (most of a rebuild's time: downloads, pyfuse3's
# compile). The build backend is on the list: the project's wheel is built from local wheels only.
FROM ${PYTHON_IMAGE} AS requirements
COPY pyproject.toml /pyproject.toml
RUN python -c 'import tomllib; p = tomllib.load(open("/pyproject.toml", "rb")); x = p["project"]["optional-dependencies"]; print("\n".join([*p["build-system"]["requires"], *p["project"]["dependencies"], *x["mount"], *x["tier"]]))' > /requirements.txt

# ---- build: wheels for the project and its dependencies (pyfuse3 compiles here)
FROM ${PYTHON_IMAGE} AS build
# Debian point releases replace package versions in place: exact pins would break the build
# python3-dev only where the base has no Python headers (the stand-in made of Debian's python3);
# the command substitution is meant to give no word or one
# hadolint ignore=DL3008,SC2046
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libfuse3-dev pkg-config \
       $(python -c 'import sysconfig, os; print("" if os.path.exists(sysconfig.get_paths()["include"] + "/Python.h") else "python3-dev")') \
    && rm -rf /var/lib/apt/lists/*
COPY --from=requirements /requirements.txt /requirements.txt
RUN pip wheel --no-cache-dir --wheel-dir /wheels -r /requirements.txt
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sos_wire ./sos_wire
COPY sos_tier ./sos_tier
COPY sos_server ./sos_server
COPY sos_client ./sos_client
COPY sos_journal ./sos_journal
COPY spark_plugin ./spark_plugin
# tier: boto3, for serve --tier s3://... (the object-store tier, protocol.md Part 4)
RUN pip wheel --no-cache-dir --no-index --find-links /wheels --wheel-dir /wheels '.[mount,tier]'

# ---- runtime
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="sos" \
      org.opencontainers.image.description="SOS: journal replication for Spark streaming checkpoints (sos-server, sos gateway and the sos mount sidecar)" \
      org.opencontainers.image.licenses="Apache-2.0"
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends fuse3 libfuse3-3 tini \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
# the version built above (pyproject.toml); only the local wheels are used (--no-index)
ARG SOS_VERSION=0.1.0
# byte-compiled here, once: on a read-only root filesystem nothing can be compiled (and
# cached) at run time, and the base image ships its standard library without .pyc files
RUN pip install --no-cache-dir --no-index --find-links /wheels "sos[mount,tier]==${SOS_VERSION}" \
    && rm -rf /wheels \
    && python -m compileall -q /usr/local/lib/python3.11
COPY deploy/healthcheck.py /usr/local/lib/sos/healthcheck.py
# the server and the gateway run unprivileged; the mount sidecar overrides the user (FUSE
# needs /dev/fuse and CAP_SYS_ADMIN: run it as root with --user 0)
RUN groupadd --system --gid 10001 sos \
    && useradd --system --uid 10001 --gid sos --home-dir /data --shell /usr/sbin/nologin sos \
    && mkdir -p /data /cache /mnt/sos \
    && chown sos:sos /data /cache
USER 10001:10001
VOLUME ["/data"]
# 7070 server (TLS), 9870 the gateway (WebHDFS, HTTPS); the metrics (9070) are on loopback
EXPOSE 7070 9870
# the server listens with TLS only (certificate and key mounted at /tls): the health check too.
# A read-only root filesystem works: the wheels were byte-compiled when installed, so Python
# writes no __pycache__ (PYTHONDONTWRITEBYTECODE: it does not even try); the only writable
# places are the volumes (/data for the server, --cache for the gateway) and TMPDIR (a
# tmpfs / emptyDir at /tmp where the root is read-only; nothing of SOS writes there today)
# SOS_LISTEN, SOS_METRICS_LISTEN: the default command's addresses. Every interface of the
# container suits a private network namespace (docker run -p, compose, a pod); with the
# host's network (--network host) that is every interface of the host, so there give an
# address of the host: -e SOS_LISTEN=127.0.0.1:7070. The metrics stay on the container's
# loopback (their pages name every namespace and need no authentication; the server refuses
# another address without --metrics-public): a Prometheus in the container's network
# namespace scrapes them (compose: --profile monitoring); to publish them, run the command
# with --metrics 0.0.0.0:9070 --metrics-public behind a firewall that admits only
# Prometheus (docs/DEPLOY.md, Server metrics).
# SOS_NAMESPACE_QUOTA: each namespace's byte quota unless `sos-server quota` sets its own: a
# quarter of the /data volume's filesystem (a size such as 10GiB, or none, also work).
# The health check follows the running server's (or gateway's) --listen; SOS_HEALTH_ADDR,
# when set, wins.
ENV SOS_LISTEN=0.0.0.0:7070 \
    SOS_METRICS_LISTEN=127.0.0.1:9070 \
    SOS_NAMESPACE_QUOTA=25% \
    SOS_HEALTH_TLS=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TMPDIR=/tmp
HEALTHCHECK --interval=30s --timeout=10s --start-period=20s --retries=3 \
    CMD ["python", "/usr/local/lib/sos/healthcheck.py"]
ENTRYPOINT ["/usr/bin/tini", "--"]
# sh only expands the two addresses, then becomes sos-server (exec): tini's only child
CMD ["sh", "-c", "exec sos-server serve --data /data --listen \"$SOS_LISTEN\" --metrics \"$SOS_METRICS_LISTEN\" --namespace-quota \"$SOS_NAMESPACE_QUOTA\" --tls-cert /tls/tls.crt --tls-key /tls/tls.key"]
