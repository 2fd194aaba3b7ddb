# agentlog: the commands the README quotes. Everything installs itself into $(VENV) on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: install demo test test-unit lint bench-log kafka-up kafka-down clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

## The main job on the embedded default log (no server to install).
demo: install
	$(VENV)/bin/logctl demo

## The whole test suite: real Kafka (from KAFKA_BOOTSTRAP_SERVERS, Docker, or started from
## Maven Central jars) and real Postgres (AGENTLOG_PG_URL, or the embedded server).
test: install
	$(PY) -m pytest

test-unit: install
	$(PY) -m pytest -m unit

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

## Log throughput: agentlog vs raw kafka-python, side by side (starts its own broker).
bench-log: install
	$(PY) -m bench.log_throughput

## A local broker for development: make kafka-up, then use --log-url kafka://127.0.0.1:9092
kafka-up: install
	$(PY) -m log.local_kafka start --port 9092 --data-dir .cache/kafka-dev --pid-file .cache/kafka-dev.pid

kafka-down:
	$(PY) -m log.local_kafka stop --pid-file .cache/kafka-dev.pid

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache
