"""bench.train_throughput --phases: the step split runs and its parts add up to the measured step.

The tests run the bench's smoke size, config S: the same real step, phases and ablations as A and
B, with a quarter of A's compile time (the suite starts from a cold compilation cache)."""

import json
import os
import re
import subprocess
import sys

import jax.numpy as jnp
import pytest

from bench import median_interval, train_throughput
from flaxchat.kernels.cpu_muon import BF16_OPERANDS, BF16_PRODUCTS, polar_express

pytestmark = pytest.mark.slow  # runs the benchmarks: CI runs it; `-m "not slow"` skips it


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_phases_split_the_real_step(capsys, tmp_path):
    train_throughput.main(["--configs", "S", "--modes", "flaxchat", "--steps", "1", "--phases",
                           "--json", str(tmp_path / "figures.json")])
    out = capsys.readouterr().out
    assert re.search(r"^cpu: \S", out, re.M), out
    names = "step|fwd\\+bwd|update|muon-ns|rest|ns-fp32|ns-bf16p|ns-bf16o|ns-bf16|ns-products"
    phase = {m.group(1): float(m.group(2)) for m in re.finditer(rf"^\s+({names})\s+(-?[\d.]+) ms", out, re.M)}
    assert set(phase) == {"step", "fwd+bwd", "update", "muon-ns", "rest", "ns-fp32", "ns-bf16", "ns-bf16p", "ns-bf16o",
                          "ns-products"}, out
    row = re.search(r"^S\s+flaxchat\s+512\s+[\d.]+\s+[\d,]+\s+([\d.]+)%\s+(\d+)", out, re.M)
    best = re.search(r"^MFU against the best peak of this run \((\d+) GFLOP/s\): S flaxchat ([\d.]+)%", out, re.M)
    assert row and best, out
    # The run's best peak is at least the rounds' median, so the conservative MFU is the lower one.
    assert int(best.group(1)) >= int(row.group(2)) and float(best.group(2)) <= float(row.group(1)) + 0.1, out
    # The phases are differences of one interleaved run: they add up to its step.
    assert abs(phase["fwd+bwd"] + phase["update"] - phase["step"]) < 0.2, out
    assert abs(phase["muon-ns"] + phase["rest"] - phase["update"]) < 0.2, out
    # Each difference also shows the rounds' own differences: their median and middle half.
    spread = re.findall(r"^\s+rounds' own differences: median (-?[\d.]+), middle half (-?[\d.]+) to (-?[\d.]+) ms",
                        out, re.M)
    assert len(spread) == 3 and all(float(lo) <= float(mid) <= float(hi) for mid, lo, hi in spread), out
    # And muon-ns its share of each round's step, with an interval for that share's median.
    share = re.search(r"its share of each round's step: median (-?[\d.]+)%, 95% interval for that median "
                      r"(-?[\d.]+)% to (-?[\d.]+)% \(1 rounds\)", out)
    assert share and float(share.group(2)) <= float(share.group(1)) <= float(share.group(3)), out
    assert 0 < phase["fwd+bwd"] and 0 < phase["ns-fp32"] and 0 < phase["ns-bf16"], out
    m = re.search(r"in bf16 changes the update by ([\d.e+-]+), in bf16-products by ([\d.e+-]+), "
                  r"in bf16-operands by ([\d.e+-]+)", out)
    bf16, bf16p, bf16o = float(m.group(1)), float(m.group(2)), float(m.group(3))
    # bf16 rounding is visible, the iteration still reaches the same factor, and keeping the iterate
    # (and in bf16-products the Gram matrix) in fp32 is closer to fp32 than bf16 throughout.
    assert 1e-4 < bf16p < bf16 < 0.5 and 1e-4 < bf16o < bf16, out
    # --json holds the same figures as the printed table (what bench.before_after reads).
    figures = json.loads((tmp_path / "figures.json").read_text())
    assert figures["cpu"] == re.search(r"^(cpu: .*)$", out, re.M).group(1)
    (saved,) = figures["rows"]
    assert (saved["config"], saved["mode"], saved["tokens"]) == ("S", "flaxchat", 512)
    assert f"{saved['mfu']:.1f}" == row.group(1), (saved, out)
    assert set(saved["phases"]) == set(phase), saved
    for name, got in saved["phases"].items():
        assert abs(got["ms"] - phase[name]) <= 0.05, (name, got, out)
        assert abs(got["of_step"] - 100 * got["ms"] / saved["phases"]["step"]["ms"]) < 1e-9, (name, got)
    assert saved["phases"]["fwd+bwd"]["of_peak"] > 0 and saved["phases"]["rest"]["of_peak"] is None
    per = saved["phases"]["muon-ns"]["share_per_round"]
    assert f"{per['median']:.1f}" == share.group(1) and per["rounds"] == 1 and per["level"] == 0.95, per


def test_the_median_interval_is_the_binomial_order_statistics():
    values = list(range(30, 0, -1))  # 1..30, unsorted
    mid, lo, hi = median_interval(values)
    # n = 30 at 95%: P(Binomial(30, 1/2) <= 9) = 0.021 and <= 10 is 0.049 > 0.025, so ranks 10 and 21.
    assert (mid, lo, hi) == (15.5, 10.0, 21.0)
    assert median_interval(values, level=0.5)[1:] == (13.0, 18.0)  # P(B <= 12) = 0.18: ranks 13 and 18
    assert median_interval([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)  # too few for 95%: the whole range
    with pytest.raises(ValueError):
        median_interval([])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", BF16_PRODUCTS, BF16_OPERANDS])
def test_products_alone_are_polar_expresss_own_products(dtype):
    # Square, wide and tall matrices: the standard iteration and (bf16-products/-operands) the Gram form.
    mats = [jnp.ones(shape) for shape in [(64, 64), (64, 256), (256, 64), (48, 64)]]
    dots = train_throughput.dot_generals(lambda ms: [polar_express(g, 5, dtype) for g in ms], mats)
    # The products found are the ones ns_flops counts, in every form...
    call, flops = train_throughput.products_alone(dots)
    assert flops == sum(train_throughput.ns_flops(g.shape, 5, dtype) for g in mats) > 0
    assert {str(lhs.dtype) for lhs, _, _ in dots} == ({"float32"} if dtype == "float32" else
                                                      {"bfloat16"} if dtype == "bfloat16" else {"float32", "bfloat16"})
    # ...and every one of them still runs: no two are the same computation for XLA to merge.
    outputs = call()
    assert len(outputs) == len(dots)
    text = call.func.lower(*call.args).compile().as_text()
    assert len(re.findall(r" dot\(", text)) == len(dots), text[:2000]


def test_profile_sums_the_real_steps_kernels():
    # A process of its own: the trace flag must be set before the CPU backend starts.
    out = subprocess.run([sys.executable, "-m", "bench.train_throughput", "--configs", "S", "--modes", "flaxchat",
                          "--steps", "1", "--profile"], cwd=REPO, capture_output=True, text=True, timeout=240).stdout
    m = re.search(r"profile of one flaxchat step of config S .*: ([\d,]+) us in (\d+) kernels, matrix products (\d+)%", out)
    assert m, out
    assert int(m.group(2)) > 100 and int(m.group(3)) > 20, out  # a GPT step is hundreds of kernels, mostly matmuls
    rows = re.findall(r"^\s+\d+ us\s+[\d.]+%\s+\d+ x (\S+)", out, re.M)
    assert len(rows) == 12 and "while" not in rows, out  # the loop's span is not counted twice


def test_only_a_difference_of_two_medians_is_flagged_as_noise():
    note = train_throughput.noise_note
    assert "below zero" in note("muon-ns", -43.6, 20.1e9, 490e9)  # as one 4-step run read
    assert "above peak" in note("muon-ns", 23.0, 20.1e9, 490e9)
    assert note("muon-ns", 50.0, 20.1e9, 490e9) == ""
    assert note("ns-bf16p", 576.4, 322.1e9, 490e9) == ""  # measured alone: bf16 products beat the fp32 peak
    # Polar Express from bf16 operands ran alone at 238 GFLOP/s against a 220 fp32 peak: inside the
    # step at 230 it is readable, at 300 (above both) it is not.
    assert note("muon-ns", 14.8e9 / 230e9 * 1e3, 14.8e9, 220e9, ceiling=238e9) == ""
    assert "above peak" in note("muon-ns", 14.8e9 / 300e9 * 1e3, 14.8e9, 220e9, ceiling=238e9)


def test_ablate_times_each_piece_away_and_restores_the_model(capsys):
    from flaxchat import ops
    before = {attr: getattr(ops, attr[4:]) for stand_ins in train_throughput.ABLATIONS.values() for attr in stand_ins
              if attr.startswith("ops.")}
    # Two modes: the second mode's row must still name its config after the first mode's ablations.
    train_throughput.main(["--configs", "S", "--modes", "flaxchat,flaxchat", "--steps", "1", "--ablate"])
    out = capsys.readouterr().out
    assert len(re.findall(r"^S\s+flaxchat\s+512\s", out, re.M)) == 2, out
    whole = re.search(r"fwd\+bwd whole\s+([\d.]+) ms", out)
    assert whole and float(whole.group(1)) > 0, out
    for name in train_throughput.ABLATIONS:
        m = re.search(rf"without {re.escape(name)}\s+([\d.]+) ms\s+([+-][\d.]+) ms", out)
        assert m and float(m.group(1)) > 0, (name, out)
        assert abs(float(m.group(1)) - float(whole.group(1)) - float(m.group(2))) < 0.2, out
    # The stand-ins lived only while their own variant traced: the model is whole again afterwards.
    assert {attr: getattr(ops, attr[4:]) for attr in before} == before


def test_mfu_divides_each_step_by_the_peak_timed_beside_it():
    """A shared host drifts, so each round times the peak just before its step and MFU is the
    median of the rounds' ratios: a probe that reports a fixed peak gives exactly tok/s x FLOPs / peak."""
    class FixedPeak(train_throughput.PeakProbe):
        def __init__(self):
            self.samples = []

        def sample(self):
            self.samples.append(1e11)
            return 1e11

    probe = FixedPeak()
    spec = train_throughput.CONFIGS["S"]
    r = train_throughput.run_mode(spec["cfg"], 2, 1, "muon", 3, probe=probe)
    assert probe.samples == [1e11] * 3  # one peak per timed step
    assert r["peak"] == 1e11
    assert abs(r["mfu"] - 100 * r["tok_s"] * r["flops_per_tok"] / 1e11) < 1e-6 * r["mfu"]


def test_an_unknown_config_is_one_sentence(capsys):
    with pytest.raises(SystemExit, match="unknown config 'C': choose from S, A, B"):
        train_throughput.main(["--configs", "A,C"])
    # An unknown mode: refused before the peak is timed and a config compiled (it was found after both).
    with pytest.raises(SystemExit, match="unknown mode 'fast': choose from baseline, flaxchat, flaxchat16k"):
        train_throughput.main(["--configs", "S", "--modes", "flaxchat,fast"])
    assert capsys.readouterr().out == ""
