# syntax=docker/dockerfile:1
# One image for both roles:
#   server (default):  docker run -p 7070:7070 -v sos-data:/data -v "$PWD/tls:/tls:ro" IMAGE
#                      (TLS: /tls/tls.crt and /tls/tls.key, made as docs/DEPLOY.md shows)
#   mount sidecar:     docker run --device /dev/fuse --cap-add SYS_ADMIN IMAGE \
#                        sos mount NAMESPACE /mnt/sos --cache /cache --tls-ca /tls/tls.crt
# See docs/DEPLOY.md.

# ---- build: wheels for the project and its dependencies (pyfuse3 compiles here)
FROM python:3.11-slim-bookworm AS build
# Debian point releases replace package versions in place: exact pins would break the build
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libfuse3-dev pkg-config \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sos_wire ./sos_wire
COPY sos_server ./sos_server
COPY sos_client ./sos_client
COPY spark_plugin ./spark_plugin
RUN pip wheel --no-cache-dir --wheel-dir /wheels '.[mount]'

# ---- runtime
FROM python:3.11-slim-bookworm
LABEL org.opencontainers.image.title="sos" \
      org.opencontainers.image.description="SOS: journal replication for Spark streaming checkpoints (sos-server and the sos mount sidecar)" \
      org.opencontainers.image.licenses="Apache-2.0"
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends fuse3 libfuse3-3 tini \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
# the version built above (pyproject.toml); only the local wheels are used (--no-index)
ARG SOS_VERSION=0.1.0
RUN pip install --no-cache-dir --no-index --find-links /wheels "sos[mount]==${SOS_VERSION}" \
    && rm -rf /wheels
COPY deploy/healthcheck.py /usr/local/lib/sos/healthcheck.py
# the server runs unprivileged; the mount sidecar overrides the user (FUSE needs
# /dev/fuse and CAP_SYS_ADMIN: run it as root with --user 0)
RUN groupadd --system --gid 10001 sos \
    && useradd --system --uid 10001 --gid sos --home-dir /data --shell /usr/sbin/nologin sos \
    && mkdir -p /data /cache /mnt/sos \
    && chown sos:sos /data /cache
USER 10001:10001
VOLUME ["/data"]
EXPOSE 7070 9070
# the server listens with TLS only (certificate and key mounted at /tls): the health check too
ENV SOS_HEALTH_ADDR=127.0.0.1:7070 \
    SOS_HEALTH_TLS=1 \
    PYTHONUNBUFFERED=1
HEALTHCHECK --interval=30s --timeout=10s --start-period=20s --retries=3 \
    CMD ["python", "/usr/local/lib/sos/healthcheck.py"]
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["sos-server", "serve", "--data", "/data", "--listen", "0.0.0.0:7070", "--metrics", "0.0.0.0:9070", \
     "--tls-cert", "/tls/tls.crt", "--tls-key", "/tls/tls.key"]
