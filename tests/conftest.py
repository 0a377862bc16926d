"""Shared test setup.

JAX's persistent compilation cache is pointed at one folder for the whole session and inherited by
every subprocess the tests start: the tiny training runs compile the same train step again and
again (resume tests start the same script three times), and on 2 cores compiling is most of their
time. The cache lives under .pytest_cache/ (git-ignored) and never changes results.
"""

import os

_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".pytest_cache", "jax-cache")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
