# One image for every agentlog role: `docker run IMAGE ROLE [ARGS]`, ROLE one of engine, planner,
# decider, executor, cache-manager, engine-bridge, gateway, projector, console, logctl (docker/entrypoint.sh). docker-compose.yml
# runs the whole stack from it.
#
# PYTHON_IMAGE is any Debian-based image with python3 (3.11+) and its venv module; the default is
# the official one. Build with BuildKit (DOCKER_BUILDKIT=1). Where the package index is reached
# through a TLS proxy, hand its CA bundle in as a build secret that the image does not keep:
#   docker build --secret id=pip_cert,src=/etc/ssl/certs/ca-certificates.crt -t agentlog .
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE NOTICE ./
COPY schemas schemas
COPY log log
COPY services services
COPY workers workers
COPY cli cli
COPY traces traces
RUN --mount=type=secret,id=pip_cert,required=false \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi; \
    python3 -m venv /opt/agentlog \
    && /opt/agentlog/bin/pip install --no-cache-dir --disable-pip-version-check --quiet /src

FROM ${PYTHON_IMAGE}
# Non-root: the processes need no privilege; their state lives in /data (a volume in compose).
RUN groupadd --system --gid 10001 agentlog \
    && useradd --system --uid 10001 --gid agentlog --home-dir /data --create-home agentlog
COPY --from=build /opt/agentlog /opt/agentlog
COPY docker/entrypoint.sh /usr/local/bin/agentlog-role
ENV PATH=/opt/agentlog/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    AGENTLOG_DATA_DIR=/data \
    AGENTLOG_CACHE_DIR=/data/cache
USER agentlog
WORKDIR /data
ENTRYPOINT ["agentlog-role"]
CMD ["logctl", "--help"]
