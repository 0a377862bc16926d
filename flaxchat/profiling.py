"""jax.profiler traces of training steps, and the device time per operation read back from them.

`--profile-steps A:B` on a stage traces its steps A to B-1 (as a Python slice; the n-th optimizer
step is step n, as the progress lines count) into `<run>/profile/` (open it in TensorBoard's profile
plugin or in Perfetto) and prints the top operations; `bench.device_check --profile` prints the
same table for its benchmark step. For a gs:// run folder the trace is written locally first and
uploaded through `flaxchat.paths`.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
from typing import Any, Callable

from flaxchat import paths
from flaxchat.errors import UserError


def parse_steps(text: str) -> tuple[int, int] | None:
    """`--profile-steps`: '' -> None; 'A:B' -> (A, B) with 1 <= A < B."""
    if not text:
        return None
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not m or not 1 <= int(m.group(1)) < int(m.group(2)):
        raise UserError(f"--profile-steps {text!r} must be A:B with 1 <= A < B, e.g. 10:13 for steps 10, 11 and 12.")
    return int(m.group(1)), int(m.group(2))


def device_op_times(folder: str) -> dict[str, float]:
    """Seconds per operation name summed over the trace's device planes ("XLA Ops" lines); where the
    trace has no device plane (CPU), over the host's XLA compute threads ("tf_XLA..." lines), less
    the runtime's own spans around the ops (ThunkExecutor::Execute, ...: names with '::')."""
    from jax.profiler import ProfileData
    found = sorted(glob.glob(f"{folder}/**/*.xplane.pb", recursive=True), key=os.path.getmtime)
    if not found:
        return {}
    data = ProfileData.from_file(found[-1])
    devices = [p for p in data.planes if p.name.startswith("/device:")]

    def ops(plane, line) -> bool:
        return line.name == "XLA Ops" if devices else line.name.startswith("tf_XLA")

    times: dict[str, float] = {}
    for plane in devices or data.planes:
        for line in plane.lines:
            if not ops(plane, line):
                continue
            for event in line.events:
                if event.name.startswith("$") or (not devices and "::" in event.name):
                    continue
                times[event.name] = times.get(event.name, 0.0) + event.duration_ns / 1e9
    return times


def top_operations(folder: str, steps: int, top: int = 12) -> dict[str, list[tuple[str, float, float]]]:
    """The traced operations ranked by device time: `top` by operation and by kind of operation
    (fusion, convolution, ...), each as (name, ms per step, % of the traced device time)."""
    ops_time = device_op_times(folder)
    total = sum(ops_time.values()) or 1.0
    kinds: dict[str, float] = {}
    for name, seconds in ops_time.items():  # "%fusion.6606 = bf16[...] ..." -> "fusion"
        kind = re.sub(r"\.\d+$", "", name.split(" = ")[0].lstrip("%"))
        kinds[kind] = kinds.get(kind, 0.0) + seconds
    ranked = lambda d: [(name, seconds / steps * 1e3, 100 * seconds / total)
                        for name, seconds in sorted(d.items(), key=lambda kv: -kv[1])[:top]]
    return dict(top=ranked(ops_time), kinds=ranked(kinds))


def top_lines(prof: dict, indent: int = 16) -> list[str]:
    """`top_operations` as the lines `bench.device_check --profile` prints."""
    out = []
    for title in ("top", "kinds"):
        out.append(f"{'':>{indent}} device time by {'operation' if title == 'top' else 'kind of operation'} "
                   f"(a loop's own line includes its body's operations):")
        out += [f"{'':>{indent}} {share:5.1f}% {ms:8.2f} ms/step  {name[:90]}" for name, ms, share in prof[title]]
    return out


class StepProfiler:
    """Traces the steps of `--profile-steps` in a training loop: call `at(step, result)` after each
    step (`step`: steps done; `result`: an array of that step, waited on so the trace holds its device
    work), and `close()` after the loop. It starts once `start_step` steps are done (at once if the
    stage begins there) and stops after step B-1."""

    def __init__(self, spec: str, folder: str, *, start_step: int, log: Callable[[str], None] = print,
                 is_main: bool = True, process: int = 0, processes: int = 1):
        self.window = parse_steps(spec)
        self.folder = folder if processes == 1 else paths.join(folder, f"process-{process}")
        self.log, self.is_main, self.tracing = log, is_main, False
        # A trace is written locally and uploaded to a gs:// run folder; no local folder without a window.
        remote = self.window is not None and paths.is_remote(folder)
        self._local = tempfile.mkdtemp(prefix="flaxchat-profile-") if remote else self.folder
        self.at(start_step)

    def at(self, step: int, result: Any = None) -> None:
        if self.window is None:
            return
        first, stop = self.window
        if step == first - 1 and not self.tracing:
            import jax
            jax.block_until_ready(result)  # earlier steps stay out of the trace
            jax.profiler.start_trace(self._local)
            self.tracing = True
        elif step == stop - 1 and self.tracing:
            self._stop(result)

    def _stop(self, result: Any) -> None:
        import jax
        jax.block_until_ready(result)
        jax.profiler.stop_trace()
        self.tracing = False
        first, stop = self.window
        if self._local != self.folder:
            for root, _, files in os.walk(self._local):
                for name in files:
                    rel = os.path.relpath(os.path.join(root, name), self._local)
                    with open(os.path.join(root, name), "rb") as f:
                        paths.write_bytes(paths.join(self.folder, rel), f.read())
        if self.is_main:
            prof = top_operations(self._local, stop - first)
            self.log(f"profile: steps {first} to {stop - 1} traced into {self.folder} "
                     "(TensorBoard's profile tab, or ui.perfetto.dev on its .trace.json.gz)")
            for line in top_lines(prof, indent=2):
                self.log(line)
        if self._local != self.folder:
            shutil.rmtree(self._local, ignore_errors=True)  # uploaded: nothing stays outside the run folder

    def close(self, result: Any = None) -> None:
        """Stop a trace still running (the run ended inside the window)."""
        if self.tracing:
            self._stop(result)
