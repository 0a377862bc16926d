"""bench.attention: each variant traces the kernel it names, the rows print, the kernel is left as it was."""

import re

import jax
import jax.numpy as jnp
import pytest

from bench import attention
from flaxchat.kernels import cpu_attention

pytestmark = pytest.mark.slow  # runs the benchmarks: CI runs it; `-m "not slow"` skips it



def test_variants_trace_different_kernels_and_restore_the_kernel():
    before = (cpu_attention.SHORT_TILE, cpu_attention.SHORT_TOKENS)
    q = jnp.ones((1, 256, 2, 16))
    programs = {}
    for name, (setting, attend) in attention.VARIANTS.items():
        with setting():
            programs[name] = jax.jit(lambda q, attend=attend: attend(q, q, q, 64)).lower(q).as_text()
    assert len(set(programs.values())) == len(programs)  # four different computations
    assert (cpu_attention.SHORT_TILE, cpu_attention.SHORT_TOKENS) == before


def test_main_prints_a_row_per_variant(capsys):
    attention.main(["--shape", "1,128,2,16", "--window", "64", "--rounds", "2"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+(\w+)\s+[\d.]+ ms\s+paired against tiles:\s+[+-][\d.]+ ms", out, re.M)
    assert rows == list(attention.VARIANTS), out
