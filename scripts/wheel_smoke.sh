#!/usr/bin/env bash
# The package as a user gets it: build the wheel, install it into a fresh virtualenv outside the
# checkout, and from a folder with nothing of the repository in it run `logctl --version`,
# `logctl demo` (small, on the embedded log), `logctl init` on it, and a Kafka broker started
# and stopped with `python -m log.local_kafka` (its jars come from the user's cache directory).
#   scripts/wheel_smoke.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-python3}
WORK=$(mktemp -d /tmp/agentlog-wheel.XXXXXX)
chmod 755 "$WORK"  # the embedded server runs as its own user and must reach its data dir
cleanup() {
  set +e
  [ -x "$WORK/venv/bin/python" ] && "$WORK/venv/bin/python" -m log.local_kafka stop --pid-file "$WORK/kafka.pid" >/dev/null 2>&1
  [ -x "$WORK/venv/bin/python" ] && "$WORK/venv/bin/python" -m log.embedded stop --pgdata "$WORK/data/postgres" >/dev/null 2>&1
  rm -rf "$WORK"
}
trap cleanup EXIT

"$PYTHON" -m pip wheel -q --no-deps --wheel-dir "$WORK/dist" .
wheel=$(ls "$WORK"/dist/agentlog-*.whl)
echo "built $(basename "$wheel")"
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q --upgrade pip
"$WORK/venv/bin/python" -m pip install -q "$wheel"

mkdir "$WORK/elsewhere"
cd "$WORK/elsewhere"
export AGENTLOG_DATA_DIR="$WORK/data"
unset AGENTLOG_TRACES_DIR AGENTLOG_PG_URL AGENTLOG_LOG_URL KAFKA_BOOTSTRAP_SERVERS PYTHONPATH
"$WORK/venv/bin/logctl" --version
"$WORK/venv/bin/logctl" demo --sessions 4 --arrival-rate 2 --json > demo.json
"$WORK/venv/bin/python" - demo.json <<'PY'
import json, sys
result = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
s = result["summary"]
assert s["sessions"] == 4 and s["finished"] == 4, s
assert result["engine"]["num_served"] == s["llm_calls"] > 4, result["engine"]
print(f"demo from the wheel: {s['finished']}/{s['sessions']} sessions finished, {s['llm_calls']} LLM calls")
PY
"$WORK/venv/bin/logctl" init --json
"$WORK/venv/bin/python" -m log.local_kafka start --port 19192 --data-dir "$WORK/kafka" --pid-file "$WORK/kafka.pid"
"$WORK/venv/bin/logctl" init --log-url kafka://127.0.0.1:19192 --json
"$WORK/venv/bin/python" -m log.local_kafka stop --pid-file "$WORK/kafka.pid"
echo "wheel smoke test passed"
