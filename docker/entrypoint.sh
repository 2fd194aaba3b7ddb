#!/bin/sh
# The image's entry point: the first argument names the role, the rest are its arguments.
set -e
role=${1:-}
[ $# -gt 0 ] && shift
case "$role" in
  engine)        exec python3 -m workers.engines.sim_server "$@" ;;
  planner)       exec python3 -m workers.planner "$@" ;;
  decider)       exec python3 -m workers.decider "$@" ;;
  executor)      exec python3 -m workers.executor "$@" ;;
  cache-manager) exec python3 -m workers.cache_manager "$@" ;;
  engine-bridge) exec python3 -m workers.engine_bridge "$@" ;;
  gateway)       exec python3 -m workers.gateway "$@" ;;
  recorder)      exec python3 -m workers.engines.recorder "$@" ;;
  projector)     exec python3 -m workers.projector "$@" ;;
  console)       exec python3 -m workers.console "$@" ;;
  logctl)        exec logctl "$@" ;;
  *)
    echo "agentlog image: unknown role '$role'; use one of: engine planner decider executor cache-manager engine-bridge gateway recorder projector console logctl" >&2
    exit 2 ;;
esac
