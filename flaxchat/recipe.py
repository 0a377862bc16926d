"""nanochat's recipe for a pretraining run's size: the horizon, the batch, the learning-rate and
weight-decay scaling, and the batch geometry (micro-batches x rows x sequence) that fills a step.

`scaling` is base_train.py's rule: D = tokens-per-parameter x scaling parameters; the automatic
batch B_ref (D/D_ref)^0.383 rounded to a power of two; LRs x sqrt(B/B_ref); weight decay
x sqrt(B/B_ref) D_ref/D. `batch_scaling_applies` decides where flaxchat applies the LR part with a
batch the user gives (docs/recipe.md); `geometry` turns the batch into gradient accumulation.
"""

from __future__ import annotations

import dataclasses
import math

from flaxchat.errors import UserError

B_REF = 2**19  # tokens per step at which nanochat's d12 hyperparameters were tuned
BATCH_EXPONENT = 0.383  # Power Lines (arXiv 2505.13738): B_opt grows as D^0.383


@dataclasses.dataclass(frozen=True)
class Scaling:
    target_tokens: float  # D = tokens-per-parameter x scaling parameters
    reference_tokens: float  # D_ref, the same for the d12 reference model
    total_batch_size: int  # B, tokens per step
    batch_lr_scale: float  # sqrt(B / B_ref)
    weight_decay: float  # lambda_ref * sqrt(B / B_ref) * D_ref / D


def scaling(n_scaling: int, n_scaling_ref: int, param_data_ratio: float, weight_decay: float,
            total_batch_size: int = -1) -> Scaling:
    """nanochat's rules: the horizon D, the batch (auto when -1: B_ref (D/D_ref)^0.383 rounded to
    a power of two), LRs scaled by sqrt(B/B_ref), and weight decay by sqrt(B/B_ref) D_ref/D (the
    T_epoch rule of arXiv 2405.13698 with that LR scaling)."""
    D = param_data_ratio * n_scaling
    D_ref = param_data_ratio * n_scaling_ref
    B = total_batch_size
    if B <= 0:
        B = 2 ** round(math.log2(B_REF * (D / D_ref) ** BATCH_EXPONENT))
    ratio = B / B_REF
    return Scaling(D, D_ref, int(B), math.sqrt(ratio), weight_decay * math.sqrt(ratio) * D_ref / D)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """How a step's tokens are laid out: `grad_accum` micro-batches of `rows` x `seq_len`, `steps` of them."""
    total: int  # tokens per step
    grad_accum: int
    rows: int  # rows per micro-batch, over all devices
    seq_len: int
    steps: int

    def line(self) -> str:
        """The `batch:` line every run prints (the README's main-job figures are read against it)."""
        return batch_line(self.total, self.grad_accum, self.rows, self.seq_len, self.steps)


def geometry(rule: Scaling, *, device_batch_size: int, devices: int, seq_len: int, steps: int) -> Geometry:
    """The micro-batches that fill `rule.total_batch_size`; `steps` <= 0 takes the rule's horizon."""
    total, rows = rule.total_batch_size, device_batch_size * devices
    if total < rows * seq_len:
        raise UserError(f"--total-batch-size {total} is smaller than one micro-batch (device_batch_size x devices x "
                        f"sequence_len = {rows * seq_len}); lower --device-batch-size or raise --total-batch-size.")
    if total % (rows * seq_len):
        raise UserError(f"--total-batch-size {total} is not a multiple of device_batch_size x devices x "
                        f"sequence_len = {rows * seq_len}.")
    steps = steps if steps > 0 else max(1, int(rule.target_tokens // total))
    return Geometry(total, total // (rows * seq_len), rows, seq_len, steps)


def batch_line(total: int, grad_accum: int, rows: int, seq_len: int, steps: int) -> str:
    """The `batch:` line every run prints (the README's main-job figures are read against it)."""
    return (f"batch: {total:,} tokens/step = {grad_accum} micro-batch(es) of {rows} x {seq_len}; "
            f"{steps:,} steps = {steps * total / 1e6:.1f}M tokens")


# nanochat's sqrt(B/2^19) LR rule with a batch you give applies once a run reads its training text
# this many times or more. Measured with bench.quality at 2,048 tokens per step (docs/recipe.md): on
# a text read 4.9 times the LRs as given memorised it (val bpb 2.28 -> 2.79 from step 200 to 600,
# nanochat 2.15) and the rule ended at 2.13-2.14 (two seeds); on one read 1.3 times the LRs as given ended 0.12 below
# the rule; on Vim's help files (~0.3 passes) and the built-in stories, 0.2 and 0.1 below.
REPEAT_PASSES = 2.0


def batch_scaling_applies(mode: str, total_batch_size: int, passes: float | None) -> bool:
    """Whether every LR is scaled by sqrt(B/2^19): always with `on`, never with `off`; with `auto`
    at nanochat's automatic batch (-1, where the rule was made) and, with a batch you give, when
    the run reads its training text REPEAT_PASSES times or more (`passes`; None: not known)."""
    if mode != "auto":
        return mode == "on"
    return total_batch_size <= 0 or (passes is not None and passes >= REPEAT_PASSES)


def estimated_passes(source, tokenizer, tokens: int, seq_len: int, sample: int = 256) -> float | None:
    """How many times `tokens` of training read `source`, from up to `sample` of its documents
    spread over it, each counted as the loader packs it (BOS + tokens, cut at a row of seq_len + 1).
    A streamed corpus (parquet shards) counts its documents from the files' footers and samples
    them from up to 8 row groups spread over it, each read once; None only for an empty corpus."""
    from flaxchat.data.loader import cut_document, is_streaming
    n = len(source)
    if n == 0:
        return None
    if is_streaming(source):
        groups = min(8, source.num_units)
        units = sorted({g * (source.num_units - 1) // max(groups - 1, 1) for g in range(groups)})
        per = max(1, sample // len(units))
        picks = sorted({source.units[u].start + k * (source.units[u].rows - 1) // max(per - 1, 1)
                        for u in units for k in range(min(per, source.units[u].rows))})
        texts = source.doc_batch(picks)
    else:
        picks = sorted({i * (n - 1) // max(min(sample, n) - 1, 1) for i in range(min(sample, n))})
        texts = [source.doc(i) for i in picks]
    # Only a row's worth of each document counts, so a long one is tokenized only that far.
    ids = tokenizer.encode([cut_document(t, seq_len + 1) for t in texts])
    sizes = [min(len(i) + 1, seq_len + 1) for i in ids]
    return tokens / (n * sum(sizes) / len(sizes))


def lr_rule_text(mode: str, given_batch: int, applied: bool, total: int, scale: float, passes: float | None) -> str:
    """What the `recipe:` line says of nanochat's sqrt(B/2^19) LR rule: on or off, and why."""
    rule = f"sqrt({total:,}/2^19) = {scale:.4f}"
    if mode != "auto":
        why = f"--lr-batch-scaling {mode}"
    elif given_batch <= 0:
        why = "--lr-batch-scaling auto, at the automatic batch"
    elif passes is None:
        why = "--lr-batch-scaling auto, and how often a streamed corpus is read is not known"
    else:
        why = (f"--lr-batch-scaling auto: the run reads its text {passes:.1f} time(s), "
               f"{'at least' if applied else 'under'} {REPEAT_PASSES:g}")
    return (f"LRs x{scale:.4f}, nanochat's batch rule {rule} on ({why})" if applied else
            f"LRs x1.0000 as given, nanochat's batch rule {rule} off ({why})")
