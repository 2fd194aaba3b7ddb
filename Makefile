# agentlog: the commands the README quotes. Everything installs itself into $(VENV) on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

.PHONY: install demo test test-unit lint bench-log kafka-up kafka-down clean vllm-install tiny-model long-model vllm-up vllm-down test-vllm bench-vllm

## vLLM lives in its own virtualenv (it pins torch and transformers): the CPU build where there
## is no GPU (scripts/install_vllm.sh says how), the regular wheel on a GPU machine.
VLLM_VENV ?= .cache/vllm-venv
TINY_MODEL ?= .cache/tiny-llama
VLLM_RUN ?= .cache/vllm-run
VLLM_BLOCKS ?= 48

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

## The codec's hot readers and writer, and the cache manager's core (services/cache), compiled with mypyc
## (log/native.py); without a C compiler they run as they are.
log/_native/.built: $(VENV)/.installed log/head_reader.py log/body_reader.py log/body_writer.py log/native.py \
		$(wildcard services/cache/*.py) scripts/compile_native.py
	$(PY) scripts/compile_native.py
	touch $@

install: $(VENV)/.installed log/_native/.built

## The main job on the embedded default log (no server to install).
demo: install
	$(VENV)/bin/logctl demo

## The whole test suite: real Kafka (from KAFKA_BOOTSTRAP_SERVERS, Docker, or started from
## Maven Central jars), real Postgres (AGENTLOG_PG_URL, or the embedded server) and real vLLM
## (AGENTLOG_VLLM_URL, or a server the tests start from $(VLLM_VENV), installed on first use).
test: install $(if $(AGENTLOG_VLLM_URL),,tiny-model)
	AGENTLOG_VLLM_PYTHON=$${AGENTLOG_VLLM_PYTHON:-$(VLLM_VENV)/bin/python} AGENTLOG_REQUIRE_VLLM=1 $(PY) -m pytest

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

## vLLM: install (~2 min cold, seconds from uv's cache), the tiny random model (seconds), a server
## with the project's scheduler and KV events (~35 s to start on 2 cores), its tests, its bench.
vllm-install:
	scripts/install_vllm.sh $(VLLM_VENV)

tiny-model: vllm-install
	env -u PYTHONDONTWRITEBYTECODE $(VLLM_VENV)/bin/python scripts/make_tiny_model.py $(TINY_MODEL)

## The regime where a prefill costs real time (bench/vllm_agents.py --regime long): 6 layers, an 8k window.
long-model: vllm-install
	env -u PYTHONDONTWRITEBYTECODE $(VLLM_VENV)/bin/python scripts/make_tiny_model.py --shape long .cache/long-llama

vllm-up: install tiny-model
	AGENTLOG_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(PY) -m workers.engines.vllm.server start --model $(TINY_MODEL) \
		--run-dir $(VLLM_RUN) --num-gpu-blocks $(VLLM_BLOCKS) --pid-file $(VLLM_RUN).pid > $(VLLM_RUN).env
	@cat $(VLLM_RUN).env

vllm-down:
	$(PY) -m workers.engines.vllm.server stop --pid-file $(VLLM_RUN).pid

## The real-vLLM tests (they start their own server unless AGENTLOG_VLLM_URL is set).
test-vllm: install tiny-model
	AGENTLOG_VLLM_PYTHON=$(VLLM_VENV)/bin/python AGENTLOG_REQUIRE_VLLM=1 $(PY) -m pytest tests/integration/vllm

## Trace workload on real vLLM, with and without the cache manager, side by side (starts its own servers).
bench-vllm: install tiny-model
	AGENTLOG_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(PY) -m bench.vllm_agents

clean:
	rm -rf $(VENV) .cache .pytest_cache .mypy_cache .ruff_cache log/_native/*.so log/_native/.built services/cache/_native
