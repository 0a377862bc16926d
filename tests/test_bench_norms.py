"""bench.norms: each op's hand-written form is checked against autodiff before it is timed."""
import re

import jax
import pytest

from bench import norms


def test_prints_a_paired_row_per_op_and_shape(capsys):
    norms.main(["--rounds", "2"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\s+(rotary_rms_norm|rms_norm)\s+\(([\d, ]+)\)\s+hand-written\s+([\d.]+) ms, autodiff\s+([\d.]+) ms",
                      out, re.M)
    assert [r[0] for r in rows] == ["rotary_rms_norm", "rms_norm"] * len(norms.SHAPES), out
    assert all(float(a) > 0 and float(b) > 0 for *_, a, b in rows)


def test_a_wrong_backward_is_refused_before_timing():
    x_shape, ours, plain = norms.variants((2, 16, 2, 8))["rotary_rms_norm"]
    with pytest.raises(RuntimeError, match="backward disagrees"):
        norms.time_pair(x_shape, lambda x: jax.lax.stop_gradient(ours(x)), plain, rounds=1)  # same forward, no backward
