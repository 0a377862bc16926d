"""bench.train_throughput --phases: the step split runs and its parts add up to the measured step."""

import os
import re
import subprocess
import sys

from bench import train_throughput

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_phases_split_the_real_step(capsys):
    train_throughput.main(["--configs", "A", "--modes", "flaxchat", "--steps", "1", "--phases"])
    out = capsys.readouterr().out
    assert re.search(r"^cpu: \S", out, re.M), out
    step_ms = float(re.search(r"^A\s+flaxchat\s+2,048\s+([\d.]+)", out, re.M).group(1))
    phase = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\s+(fwd\+bwd|update|muon-ns)\s+(-?[\d.]+) ms", out, re.M)}
    assert set(phase) == {"fwd+bwd", "update", "muon-ns"}, out
    assert abs(phase["fwd+bwd"] + phase["update"] - step_ms) < 0.2, out  # update is the step minus fwd+bwd
    assert 0 < phase["fwd+bwd"] and 0 < phase["muon-ns"], out
    peaks = [float(x) for x in re.findall(r"([\d.]+)% of peak", out)]
    assert len(peaks) == 2 and all(0 < p < 200 for p in peaks), out  # fwd+bwd and muon-ns carry FLOPs


def test_profile_sums_the_real_steps_kernels():
    # A process of its own: the trace flag must be set before the CPU backend starts.
    out = subprocess.run([sys.executable, "-m", "bench.train_throughput", "--configs", "A", "--modes", "flaxchat",
                          "--steps", "1", "--profile"], cwd=REPO, capture_output=True, text=True, timeout=240).stdout
    m = re.search(r"profile of one flaxchat step of config A .*: ([\d,]+) us in (\d+) kernels, matrix products (\d+)%", out)
    assert m, out
    assert int(m.group(2)) > 100 and int(m.group(3)) > 20, out  # a GPT step is hundreds of kernels, mostly matmuls
    rows = re.findall(r"^\s+\d+ us\s+[\d.]+%\s+\d+ x (\S+)", out, re.M)
    assert len(rows) == 12 and "while" not in rows, out  # the loop's span is not counted twice
