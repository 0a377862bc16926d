"""The GPU's kernels: cuDNN's fused flash attention, everything else the plain ops XLA fuses.

Not yet measured on a GPU here; `python -m bench.device_check` on one prints what each kernel does.
"""

from __future__ import annotations

import jax

from flaxchat import ops

DEFAULT_ATTENTION = "cudnn"
_announced: set = set()


def choice(attention_name: str, attention, grad_checkpoint: bool):
    """The GPU's records (`flaxchat.kernels.Choice`) with the given attention (`record.accelerator_choice`)."""
    from flaxchat.kernels.record import accelerator_choice
    return accelerator_choice("gpu", attention_name, attention, grad_checkpoint)


def cudnn_attention(q, k, v, window: int, block: int | None = None) -> jax.Array:
    """cuDNN's fused flash attention with its local window; XLA's form where cuDNN does not take
    the call (no GPU, fp32 inputs, a head size it lacks), said once."""
    try:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                            local_window_size=ops.local_window(window, q.shape[1]),
                                            implementation="cudnn")
    except Exception as e:  # cuDNN refuses at trace time, with a reason
        key = type(e).__name__
        if key not in _announced and jax.process_index() == 0:
            print(f"attention: cudnn unavailable here ({key}: {str(e).splitlines()[0][:120]}); using xla", flush=True)
        _announced.add(key)
        return ops.xla_attention(q, k, v, window)


ATTENTION = {"cudnn": cudnn_attention}  # the kernels this file adds to --attention
