"""bench/cycles.py: perf's samples of this process, grouped by what the CPU was doing."""

import jax
import jax.numpy as jnp
import pytest

from bench import cycles

# The top of `perf report --sort dso,symbol --stdio` for config A's train step on a 2-core Intel
# Xeon (AMX), cut to 110 columns; perf pads every line to its longest symbol.
REPORT = """\
# Samples: 60K of event 'cpu-clock:pppH'
#
# Overhead  Shared Object         Symbol
# ........  ....................  ..........
#
    63.36%  libjax_common.so      [.] ynn::dot_fp32_5x64x1_1x16x1_avx512                                    -      -
     4.84%  [kernel.kallsyms]     [k] clear_page_erms                                                       -      -
     2.83%  libjax_common.so      [.] ynn::transpose_x2048_avx                                              -      -
     1.22%  libjax_common.so      [.] ynn::dot_bf16_bf16_fp32_32x32x32_16x16x2_amxbf16                      -      -
     1.09%  libjax_common.so      [.] ynn::interleave2_x16_avx512                                           -      -
     1.06%  libjax_common.so      [.] ynn::multiply_fp32_x86_avx512f_avx512bw                               -      -
     0.85%  libc.so.6             [.] __memmove_avx512_unaligned_erms                                       -      -
     0.41%  libjax_common.so      [.] ynn::sum_k1_fp32_avx512                                               -      -
     0.32%  [JIT] tid 3761        [.] 0x00007f3021c6b0b9                                                    -      -
     0.24%  [JIT] tid 3761        [.] 0x00007f3021a5617b                                                    -      -
     0.21%  libc.so.6             [.] _int_free                                                             -      -
     0.19%  libjax_common.so      [.] Eigen::ThreadPoolTempl<tsl::thread::EigenEnvironment>::GlobalSteal    -      -
     0.19%  libpython3.11.so.1.0  [.] _PyEval_EvalFrameDefault                                              -      -
     0.10%  [kernel.kallsyms]     [k] page_reporting_bitmap_mark_allocated                                  -      -
     0.05%  [kernel.kallsyms]     [k] _raw_spin_unlock_irqrestore                                           -      -
     0.04%  libstdc++.so.6.0.30   [.] operator new                                                          -      -
"""


def test_a_report_is_summed_by_kind():
    shares = cycles.parse_report(REPORT)
    expect = {
        "products, fp32 (microkernels)": 63.36,
        "OS: zeroing, faulting in pages": 4.84 + 0.10,
        "operand packing, transposes": 2.83 + 1.09,
        "products, bf16 operands": 1.22,
        "YNNPACK elementwise, reductions": 1.06 + 0.41,
        "malloc, free, memcpy": 0.85 + 0.21,
        "XLA-generated loops": 0.32 + 0.24,  # perf names the object "[JIT] tid N", with a space
        "thread pool": 0.19,
        "Python": 0.19,
        "OS: other": 0.05,
        "other": 0.04,
    }
    assert set(shares) == set(expect)
    for kind, pct in expect.items():
        assert shares[kind] == pytest.approx(pct), kind
    assert list(shares)[0] == "products, fp32 (microkernels)"  # largest first


@pytest.mark.timeout(300)
def test_a_product_loop_samples_as_products():
    why = cycles.unavailable()
    if why:
        pytest.skip(why)
    a = jnp.ones((1024, 1024), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()

    def run():
        for _ in range(20):
            f(a).block_until_ready()

    usage, shares = cycles.sample(run, calls=3)
    assert usage["wall_ms"] > 0 and usage["user_ms"] > 0 and 0 < usage["busy"] <= 1.5
    assert shares, "perf recorded no samples"
    largest = max(shares, key=shares.get)
    assert largest == "products, fp32 (microkernels)", shares
