"""mypyc builds of ``log.head_reader`` and ``log.body_reader`` (``scripts/compile_native.py``).

Only build outputs live here (ignored by git); ``log.native`` loads them when they were
built from the current sources.
"""
