"""vLLM as agentlog's engine: launcher, scheduler subclass and its control channel.

- ``server``: starts vLLM's OpenAI-compatible server (from its own virtualenv) with the
  project's scheduler, KV events on private ipc sockets, per-request metrics; prints the
  endpoints. Runs in the project's venv and never imports vllm.
- ``scheduler``: ``AgentlogScheduler``, loaded inside vLLM with ``--scheduler-cls``: pins a
  session's KV blocks after a call (TTL or explicit release), discards them, and under
  memory pressure releases pins in the order the cache manager ranked them. Imports vllm.
- ``pins``: the pin table's pure logic (expiry, release order).
- ``control``: the control channel's wire format, its client (the engine bridge's
  actuator) and its server loop (a thread inside the scheduler).

docs/vllm.md has the whole picture.
"""
