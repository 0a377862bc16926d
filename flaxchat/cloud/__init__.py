"""Train on Cloud TPU VMs and pod slices: `TPULauncher(TPUConfig(...))`, or `python -m flaxchat.cloud.launcher`.

Light on purpose: nothing here imports JAX, so the launcher starts at once on a laptop without an
accelerator. `topology` (slice shapes), `gcloud` (command builders + executor), `recovery` (the
preemption state machine), `emulator` (a local gcloud stand-in for rehearsals), `worker` (what
runs on each VM).
"""

__all__ = ["TPULauncher", "TPUConfig", "num_workers_for"]


def __getattr__(name):
    if name in ("TPULauncher", "TPUConfig"):
        from flaxchat.cloud import launcher
        return getattr(launcher, name)
    if name == "num_workers_for":
        from flaxchat.cloud.topology import num_workers_for
        return num_workers_for
    raise AttributeError(name)
