#!/usr/bin/env bash
# Write .env for docker-compose.yml: a random password for every Kafka principal of log/acls.py,
# for Postgres, and the vLLM control token. Keeps an existing .env (pass --force to replace it).
#   scripts/compose_env.sh [--force] [FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
force=""
[ "${1:-}" = "--force" ] && { force=1; shift; }
file=${1:-.env}
if [ -e "$file" ] && [ -z "$force" ]; then
  echo "$file exists; keeping it (scripts/compose_env.sh --force replaces it)" >&2
  exit 0
fi
secret() { head -c 18 /dev/urandom | od -An -tx1 | tr -d ' \n'; }
umask 077
{
  echo "# docker-compose.yml's secrets, made by scripts/compose_env.sh. Keep this file private."
  echo "COMPOSE_PROJECT_NAME=agentlog"
  for principal in ADMIN PLANNER DECIDER EXECUTOR CACHE_MANAGER ENGINE_BRIDGE PROJECTOR OPERATOR AUDITOR GATEWAY; do
    echo "AGENTLOG_PASSWORD_$principal=$(secret)"
  done
  echo "AGENTLOG_POSTGRES_PASSWORD=$(secret)"
  echo "AGENTLOG_VLLM_CONTROL_TOKEN=$(secret)"
  echo "AGENTLOG_GRAFANA_PASSWORD=$(secret)"
  echo "AGENTLOG_GATEWAY_API_KEY=$(secret)"
  echo "AGENTLOG_CONSOLE_PASSWORD=$(secret)"
  echo "AGENTLOG_CONSOLE_AUDITOR_PASSWORD=$(secret)"
  echo "AGENTLOG_CONSOLE_SECRET=$(secret)"
} > "$file"
echo "wrote $file"
