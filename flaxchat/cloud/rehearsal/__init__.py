"""The pod rehearsal's stand-ins for Google: what `--backend=local` talks to instead of the cloud.

    emulator.py   the `gcloud` CLI (TPU VMs, queued resources, ssh/scp, storage) on this machine,
                  with stock-image workers (Python 3.10), preemptions, stockouts, ssh failures
    bucket.py     gs:// as a folder beside the emulated VMs (fsspec and Orbax's TensorStore spec)

Production code never imports these except at the one place the backend is chosen
(`flaxchat.cloud.launcher.executor_for`), and never asks whether it is talking to them.
"""
