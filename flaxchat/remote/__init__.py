"""Run flaxchat somewhere else: this machine (LocalRunner), a Kaggle kernel (KaggleRunner), a TPU pod.

Imports are lazy so that `from flaxchat.remote import KaggleRunner` does not pull in JAX.
"""

from flaxchat.runner.base import (
    RemoteConnectionError,
    RemoteError,
    RemoteRunner,
    RemoteTimeout,
    RunResult,
    RunStatus,
)

__all__ = [
    "RemoteRunner", "RunResult", "RunStatus", "RemoteError", "RemoteTimeout",
    "RemoteConnectionError", "LocalRunner", "KaggleRunner",
]


def __getattr__(name):
    if name == "LocalRunner":
        from flaxchat.remote.local import LocalRunner
        return LocalRunner
    if name == "KaggleRunner":
        from flaxchat.remote.kaggle import KaggleRunner
        return KaggleRunner
    raise AttributeError(name)
