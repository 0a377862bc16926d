"""flaxchat: a readable LLM training harness in JAX/Flax NNX (a port of nanochat).

Importing the package does no work: modules import JAX only where they need it, so the cloud
launcher and the remote runners start fast on machines without an accelerator.
"""

__version__ = "0.1.0"
