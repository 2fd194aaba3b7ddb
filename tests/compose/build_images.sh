#!/usr/bin/env bash
# Build, on a machine that reaches no image registry, every image docker-compose.yml needs:
#   agentlog-test/debian:bookworm   a base filesystem made by mmdebstrap from Debian's packages
#   agentlog-test/python:3.11       stands in for python:3.11-slim      (images/python)
#   agentlog-test/kafka:4.1.1       stands in for apache/kafka:4.1.1    (images/kafka)
#   agentlog-test/postgres:15       stands in for postgres:18           (images/postgres)
#   agentlog:test                   the project's own image (Dockerfile), FROM agentlog-test/python
# docker-compose.yml names the official images by default; the compose test points it at these
# through AGENTLOG_*_IMAGE variables. An image already present is kept (REBUILD=1 rebuilds all).
# Where the package index is reached through a TLS proxy, its CA bundle (PIP_CERT, else the
# system's) goes into the builds as a BuildKit secret, never into an image.
set -euo pipefail
cd "$(dirname "$0")"
REPO=$(cd ../.. && pwd)
PYTHON=${PYTHON:-python3}
# BuildKit is needed (build secrets). A docker CLI without the buildx plugin cannot use it; Debian's
# docker.io CLI (/usr/bin/docker) has it built in, so it is preferred where it exists.
DOCKER=${DOCKER:-$( [ -x /usr/bin/docker ] && echo /usr/bin/docker || echo docker )}
export DOCKER_BUILDKIT=1
CERT=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
secret=()
[ -s "$CERT" ] && secret=(--secret "id=pip_cert,src=$CERT")

have() { [ -z "${REBUILD:-}" ] && "$DOCKER" image inspect "$1" > /dev/null 2>&1; }

if ! have agentlog-test/debian:bookworm; then
  tmp=$(mktemp -d)
  mmdebstrap --quiet --variant=minbase --include=ca-certificates bookworm "$tmp/base.tar"
  "$DOCKER" import "$tmp/base.tar" agentlog-test/debian:bookworm > /dev/null
  rm -rf "$tmp"
fi
have agentlog-test/python:3.11 || "$DOCKER" build -q -t agentlog-test/python:3.11 images/python > /dev/null
if ! have agentlog-test/kafka:4.1.1; then
  libs=$("$PYTHON" -c "from log.local_kafka import resolve_jars; print(resolve_jars())")
  context=$(mktemp -d)
  cp -r images/kafka/. "$context/"
  cp -r "$libs" "$context/libs"
  cp "$REPO/log/broker/log4j2.properties" "$context/"
  "$DOCKER" build -q -t agentlog-test/kafka:4.1.1 "$context" > /dev/null
  rm -rf "$context"
fi
have agentlog-test/postgres:15 || "$DOCKER" build -q -t agentlog-test/postgres:15 images/postgres > /dev/null
# The project image is always rebuilt (its layers are cached): it must be the code under test.
"$DOCKER" build -q "${secret[@]}" --build-arg PYTHON_IMAGE=agentlog-test/python:3.11 -t agentlog:test "$REPO" > /dev/null
echo "images ready: agentlog:test agentlog-test/kafka:4.1.1 agentlog-test/postgres:15"
