"""bench.products: the bf16 forms are what they claim (their error against float64) and main prints a row a shape."""
import re

from bench import products


def test_bf16x3_keeps_about_twice_bf16s_bits():
    res = products.measure(64, 128, 32, rounds=1)
    err = {name: e for name, (_, e) in res.items()}
    assert err["fp32"] < 1e-6 and 1e-4 < err["bf16"] < 1e-2, err
    # Two bf16 parts carry ~16 bits: the dropped lo·lo term and the remainder's rounding, ~2^-16 relative.
    assert err["bf16"] / 50 > err["bf16x3"] > err["fp32"] and err["bf16x3"] < 3e-5, err
    assert abs(err["bf16x3-cat"] - err["bf16x3"]) < 0.5 * err["bf16x3"], err  # the same three products


def test_main_prints_the_cpu_and_a_row_per_shape(capsys, monkeypatch):
    monkeypatch.setattr(products, "SHAPES", [(32, 64, 16, "small"), (16, 32, 64, "other")])
    products.main(["--rounds", "1"])
    out = capsys.readouterr().out
    assert re.search(r"^cpu: \S", out, re.M), out
    rows = re.findall(r"^\s*(\d+) x\s+(\d+) x\s+(\d+)\s+fp32\s+\d+ \(\S+\)\s+bf16\s+\d+ .*(small|other)$", out, re.M)
    assert [r[-1] for r in rows] == ["small", "other"], out
