"""bench.ns_accuracy: Polar Express's dtypes against float64, on a real training run's Muon inputs."""
import numpy as np
import pytest

from bench import ns_accuracy


@pytest.fixture(scope="module")
def table():
    # Depth 1 (64-wide): square, wide and tall matrices and the value gate, as at depth 4.
    return ns_accuracy.measure(ns_accuracy.muon_inputs(depth=1, at=[1, 3], vocab_size=512, seq=64))


def test_the_dtypes_land_in_their_order_on_every_shape(table):
    assert sorted(table) == [1, 3]
    for rows in table.values():
        assert {(64, 64), (64, 256), (256, 64)} <= set(rows)
        for shape, cells in rows.items():
            worst = {dt: max(v) for dt, v in cells.items()}
            assert worst["float32"] < 1e-4, (shape, worst)  # fp32 is float64's iteration to rounding
            assert np.median(cells["bfloat16"]) > 1e-3, (shape, worst)  # bf16 throughout is visibly off
            assert np.median(cells["bf16-products"]) < np.median(cells["bfloat16"]), (shape, worst)


def test_bad_steps_are_one_sentence(capsys):
    with pytest.raises(SystemExit) as e:
        ns_accuracy.main(["--at", "five"])
    assert e.value.code == 2 and "--at takes comma-separated step numbers" in capsys.readouterr().err
