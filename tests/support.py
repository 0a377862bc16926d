"""What many test files share: the tiny models, the tokenizer, the tiny training flags, and the
helpers that start training processes. A plain module (`from support import ...`; tests/ is on
sys.path); tests/conftest.py turns the shared ones into fixtures. Heavy imports stay inside the
functions, so importing this costs nothing."""

from __future__ import annotations

import functools
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- tiny training runs ---------------------------------------------------------------------------

# The smallest pretraining run the scripts take (depth 1, 32-token rows, a 300-token vocabulary):
# its train step compiles in seconds and is cached on disk across the suite's runs.
TINY_RUN = {"depth": 1, "sequence_len": 32, "vocab_size": 300, "device_batch_size": 2, "total_batch_size": 128,
            "log_every": 1, "num_samples": 1, "max_chars_tokenizer": 300_000}


def tiny_flags(**changes) -> list[str]:
    """TINY_RUN with `changes` (None drops a flag) as command-line flags, e.g.
    tiny_flags(eval_every=0, sample_every=0)."""
    values = {**TINY_RUN, **changes}
    return [f"--{k.replace('_', '-')}={v}" for k, v in values.items() if v is not None]


# --- processes ------------------------------------------------------------------------------------

# Compiled executables are cached on disk across runs with the same device layout (the pod
# rehearsal, its resumed run and its reference share them): minutes of XLA compiling saved.
JAX_CACHE = os.path.join(tempfile.gettempdir(), "flaxchat-test-jax-cache")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cache_env() -> dict:
    """The session's cache (tests/conftest.py sets one) or ours; every run and worker uses the same."""
    return {"JAX_COMPILATION_CACHE_DIR": os.environ.get("JAX_COMPILATION_CACHE_DIR", JAX_CACHE),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}


def cpu_env(devices: int, **extra) -> dict:
    """This environment for a child on `devices` fake CPU devices, importing this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    return {**env, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO,
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", **cache_env(), **extra}


def coordinator_env(port: int, n: int, i: int) -> dict:
    return {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": str(n), "JAX_PROCESS_ID": str(i)}


def start(argv, devices: int, extra_env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *argv], cwd=REPO, env=cpu_env(devices, **(extra_env or {})),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"training did not finish in {timeout:.0f} s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out


# --- the tokenizer --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def stories_tokenizer(vocab_size: int = 512, docs: int = 300, max_chars: int = 200_000):
    """A BPE tokenizer trained on the built-in stories (once per process and size)."""
    from flaxchat.data.stories import StoriesCorpus
    from flaxchat.tokenizer import Tokenizer
    return Tokenizer.train([StoriesCorpus(seed=0).doc(i) for i in range(docs)], vocab_size, max_chars=max_chars)


# --- tiny models ----------------------------------------------------------------------------------

def _gpt_config(**kw):
    from flaxchat.config import GPTConfig  # no JAX: config imports only flaxchat.errors
    return GPTConfig(**kw)


# GQA (4 query heads on 2 kv heads), a 16-token sliding window on layers 0 and 2... except the last,
# which is always full: windows [16, 64, 64].
ENGINE_TINY = _gpt_config(sequence_len=64, vocab_size=512, n_layer=3, n_head=4, n_kv_head=2, n_embd=64,
                 window_pattern="SL", attn_block=16)


SCALARS = {"resid_lambdas": 1.0, "x0_lambdas": 0.1, "smear_lambda": 0.3, "backout_lambda": 0.2}


def nonzero_model(cfg=None, seed=0, base=None, noise=0.0):
    """Every parameter random (numpy, so no op-by-op JAX init): zero-initialised output projections
    would hide a broken cache. With `base`, its parameters plus `noise` (a draft that mostly agrees)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from flaxchat.gpt import GPT
    cfg = ENGINE_TINY if cfg is None else cfg
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))
    base_leaves = jax.tree.leaves(nnx.state(base, nnx.Param)) if base is not None else None
    values = []
    for i, (path, leaf) in enumerate(leaves):
        name = jax.tree_util.keystr(path)
        if base_leaves is not None:
            b = np.asarray(base_leaves[i])  # numpy's std: np.std of a jax array runs jax's, compiled per shape
            x = b + noise * rng.standard_normal(leaf.shape) * b.std()
        elif len(leaf.shape) == 2:
            x = rng.standard_normal(leaf.shape) / np.sqrt(leaf.shape[0] if "embedding" not in name else 1)
        else:
            x = next(v for k, v in SCALARS.items() if k in name) + 0.05 * rng.standard_normal(leaf.shape)
        values.append(jnp.asarray(x, jnp.float32))
    nnx.update(model, jax.tree.unflatten(treedef, values))
    return model


def scripted_model(chain: list[int], seed: int = 0):
    """An ENGINE_TINY-shaped model that, given token chain[i], writes chain[i+1] (greedy). Output projections
    are zero and the residual is the embedding alone, so logits = norm(wte[t]) @ lm_head, and
    lm_head's column for chain[i+1] is norm(wte[chain[i]]): a dot of 64 against noise of ~8."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    assert len(set(chain[:-1])) == len(chain) - 1, "each token of the chain needs one successor"
    model = nonzero_model(seed=seed)
    for block in model.blocks:
        block.attn.c_proj.kernel[...] = jnp.zeros_like(block.attn.c_proj.kernel[...])
        block.mlp.c_proj.kernel[...] = jnp.zeros_like(block.mlp.c_proj.kernel[...])
    model.resid_lambdas[...] = jnp.ones_like(model.resid_lambdas[...])
    model.x0_lambdas[...] = jnp.zeros_like(model.x0_lambdas[...])
    model.backout_lambda[...] = jnp.zeros_like(model.backout_lambda[...])
    model.smear_lambda[...] = jnp.zeros_like(model.smear_lambda[...])
    emb = np.asarray(jax.random.normal(jax.random.key(seed), model.wte.embedding.shape))
    model.wte.embedding[...] = jnp.asarray(emb)
    normed = emb / np.sqrt((emb ** 2).mean(-1, keepdims=True))
    head = np.zeros(model.lm_head.kernel.shape, np.float32)
    for a, b in zip(chain, chain[1:]):
        head[:, b] += normed[a] / 8
    model.lm_head.kernel[...] = jnp.asarray(head)
    return model


def tool_chain(tokenizer, expr):
    s = tokenizer.special_tokens
    return ([s["<|assistant_start|>"], s["<|python_start|>"]] + tokenizer.encode(expr) + [s["<|python_end|>"]],
            [s["<|output_end|>"], s["<|assistant_end|>"]])


# --- counting compiles ---------------------------------------------------------------------------

COMPILED = re.compile(r"jaxpr to MLIR module conversion jit\((\w+)\)")  # every compile, cache hits too


class CompileLog(logging.Handler):
    """The names of the functions JAX compiles while it is attached to the "jax" logger (with
    `jax.log_compiles(True)`): a bf16 step must appear once."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record):
        m = COMPILED.search(record.getMessage())
        if m:
            self.names.append(m.group(1))

