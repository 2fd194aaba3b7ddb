"""The engine bridge: an engine's KV events into ``kv.events``, ``kv.decisions`` into the engine."""
