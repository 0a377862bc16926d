"""Configuration: frozen dataclasses are the source of truth, CLI flags and their --help are derived from them.

One dial, `--depth`, sets the model's shape, its learning rates and its training horizon, as in
nanochat: width = depth x 64 (aspect ratio 64), heads of 128 channels (64 or 32 for tiny models),
and the number of steps from a tokens-per-parameter ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from typing import Any, Mapping

from flaxchat.errors import UserError

ASPECT_RATIO = 64  # n_embd = depth * 64 (nanochat)
VOCAB_MULTIPLE = 64  # pad the embedding/LM head rows so matmuls tile well; logits are cropped

# The learning rates and Muon weight decay of nanochat's base_train (tuned at d12, 2^19 tokens per
# step); the one place they live: TrainConfig's flags, OptimConfig and the later stages read them.
LR = dict(matrix_lr=0.02, embedding_lr=0.3, unembedding_lr=0.008, scalar_lr=0.5, smear_lr=0.2,
          weight_decay=0.28)
# What --attention takes: auto and every kernel in flaxchat.kernels (a test holds the two equal);
# listed here so that checking flags imports no JAX.
ATTENTION_NAMES = ("auto", "blockwise", "cudnn", "splash", "xla")
NS_DTYPES = ("auto", "float32", "bfloat16", "bf16-products", "bf16-operands")  # flaxchat.optim's Polar Express dtypes


def flag(default: Any, help: str) -> Any:
    """A config field that carries its --help text: `depth: int = flag(4, "the one dial: ...")`. A
    subclass rewords an inherited flag by redefining it with the parent's default,
    `steps: int = flag(RunConfig.steps, "optimizer steps")`; one that only changes the default
    (`run_dir: str = "runs/sft"`) keeps the parent's text (`flag_help`)."""
    return dataclasses.field(default=default, metadata={"help": help})


def check_bookkeeping(keep_checkpoints: int, **every: int) -> None:
    """One sentence for the checkpoint and cadence flags every stage has, before anything is written:
    Orbax told to keep 0 checkpoints deletes each one as it is saved, the last one too."""
    if keep_checkpoints < 1:
        raise UserError(f"--keep-checkpoints must be at least 1 (got {keep_checkpoints}): the last checkpoint is "
                        "what a run resumes from and what the next stage loads.")
    for name, n in every.items():
        if n < 0:
            raise UserError(f"--{name.replace('_', '-')} must be 0 (never) or more (got {n}).")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    sequence_len: int = 256
    vocab_size: int = 4096
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int = 4
    n_embd: int = 256
    window_pattern: str = "SSSL"  # tiled over layers; S = quarter context, L = full; last layer is L
    tie_embeddings: bool = False
    rope_base: float = 100_000.0
    logit_softcap: float = 15.0
    value_embeds: bool = True
    ve_gate_channels: int = 12  # input channels of the value-embedding gate (nanochat)
    ve_gate_scale: float = 3.0  # the gate is scale·sigmoid, in (0, scale) (nanochat)
    attn_block: int = 128  # attention's block: short windows are whole blocks (the unit of skipped work)
    # How the model runs (attention kernel, remat) is not the model: flaxchat.kernels, chosen per
    # process (--attention, --grad-checkpoint). Checkpoints written when it was here still load.

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        def bad(msg):
            raise UserError(msg)

        if self.n_layer <= 0:
            bad(f"n_layer must be positive (got {self.n_layer}); use --depth 1 or more.")
        for name in ("sequence_len", "vocab_size", "n_head", "n_kv_head", "n_embd", "attn_block"):
            if getattr(self, name) <= 0:
                bad(f"{name} must be positive (got {getattr(self, name)}).")
        if self.n_embd % self.n_head:
            bad(f"n_embd ({self.n_embd}) is not divisible by n_head ({self.n_head}); pick a head count that divides it.")
        if self.n_head % self.n_kv_head:
            bad(f"n_head ({self.n_head}) is not a multiple of n_kv_head ({self.n_kv_head}), which grouped-query attention needs.")
        if self.head_dim % 2:
            bad(f"head_dim ({self.head_dim}) must be even for rotary embeddings.")
        if not self.window_pattern or set(self.window_pattern.upper()) - {"S", "L"}:
            bad(f"window pattern {self.window_pattern!r} may only contain the letters S (short) and L (long), e.g. 'SSSL'.")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        return -(-self.vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    @property
    def short_window(self) -> int:
        # A quarter of the context (nanochat), rounded up to whole attention blocks so the blocks
        # outside the window are skipped outright rather than masked.
        quarter = max(1, self.sequence_len // 4)
        return min(self.sequence_len, -(-quarter // self.attn_block) * self.attn_block)

    def window_sizes(self) -> list[int]:
        """Per-layer attention window in tokens (a query sees keys t-window+1 .. t)."""
        pattern = self.window_pattern.upper()
        sizes = [self.short_window if pattern[i % len(pattern)] == "S" else self.sequence_len
                 for i in range(self.n_layer)]
        sizes[-1] = self.sequence_len  # the last layer always sees the full context
        return sizes

    def has_value_embed(self, layer: int) -> bool:
        # Alternating layers, the last one always included (nanochat `has_ve`).
        return self.value_embeds and layer % 2 == (self.n_layer - 1) % 2

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GPTConfig":
        # Old checkpoints stay loadable: unknown keys are dropped, missing keys take defaults, except
        # the value-embedding gate, which was 32 channels and 2·sigmoid before these fields existed.
        known = {f.name for f in dataclasses.fields(cls)}
        d = {"ve_gate_channels": 32, "ve_gate_scale": 2.0, **d}
        return cls(**{k: v for k, v in d.items() if k in known})


def config_for_depth(depth: int, *, vocab_size: int = 4096, sequence_len: int = 256, **overrides) -> GPTConfig:
    """nanochat's one dial: depth -> width (x64), heads of 128 (64/32 for tiny models)."""
    if depth <= 0:
        raise UserError(f"--depth must be at least 1 (got {depth}).")
    width = depth * ASPECT_RATIO
    head_dim = 128 if width >= 512 else 64 if width >= 256 else 32
    n_embd = -(-width // head_dim) * head_dim
    n_head = n_embd // head_dim
    fields = dict(sequence_len=sequence_len, vocab_size=vocab_size, n_layer=depth, n_head=n_head,
                  n_kv_head=n_head, n_embd=n_embd)
    fields.update(overrides)
    return GPTConfig(**fields)


SHARDINGS = ("auto", "dp", "fsdp")


def check_sharding(sharding: str) -> None:
    if sharding not in SHARDINGS:
        raise UserError(f"--sharding must be auto, dp or fsdp (got {sharding!r}).")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What every training stage's run has (pretraining's TrainConfig, SFT's and RL's StageConfig):
    its folder, its length, how often it evaluates, saves and logs, its seed, compute dtype and
    layout, and whether to start over. Checked once, here, for all of them. The help texts are
    pretraining's where the stages word a flag otherwise (`flaxchat.finetune.StageConfig`)."""

    run_dir: str = flag("runs/default", "folder for checkpoints, report, plot and samples")
    # -1: the stage derives them (pretraining: --param-data-ratio; SFT: --epochs)
    steps: int = flag(-1, "optimizer steps; -1 derives them from --param-data-ratio")
    dtype: str = flag("auto", "compute dtype: auto (bf16 on TPU/GPU, fp32 on CPU), float32, bfloat16")
    sharding: str = flag("auto", "dp (parameters replicated), fsdp (parameters, gradients and optimizer state split), "
                                 "auto")
    eval_every: int = flag(250, "steps between validation bpb evaluations, and one at the end (0: none)")
    save_every: int = flag(250, "steps between checkpoints (0: only the last step, which is always saved)")
    keep_checkpoints: int = flag(2, "how many checkpoints to keep")
    log_every: int = flag(10, "steps between progress lines")
    seed: int = flag(0, "seed of the initialisation and the data order")
    fresh: bool = flag(False, "start at step 0 even if the run folder has a checkpoint (the old one is moved aside, "
                              "not deleted)")
    # 25 s: clouds kill about 30 s after the notice
    preempt_grace: float = flag(25.0, "seconds from SIGTERM (a preemption notice) to exit: the step in flight "
                                      "finishes and is saved, exit code 75; a save still going then is given up "
                                      "(docs/deployment.md)")
    tracker: str = flag("none", "also log every figure of metrics.jsonl (loss, LR multiplier, tok/s, MFU, "
                                "validation), sampled text and the resolved config to wandb, tensorboard "
                                "(<run-dir>/tensorboard), both as a comma list, or none; a resumed run continues "
                                "the same W&B run (its id is kept in <run-dir>/trackers.json)")  # flaxchat.trackers
    run_name: str = flag("", "the run's name in the trackers (default: the run folder's name)")
    profile_steps: str = flag("", "A:B traces steps A to B-1 with jax.profiler into <run-dir>/profile (TensorBoard "
                                  "or Perfetto) and prints the top device operations, e.g. 10:13")  # flaxchat.profiling

    def validate_run(self, **every: int) -> None:
        """The shared flags' checks; `every` adds a stage's own cadences (--sample-every)."""
        check_sharding(self.sharding)
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise UserError(f"--dtype must be auto, float32 or bfloat16 (got {self.dtype!r}).")
        if self.preempt_grace <= 0:
            raise UserError(f"--preempt-grace must be more than 0 seconds (got {self.preempt_grace}).")
        if self.log_every < 1:
            raise UserError(f"--log-every must be at least 1 (got {self.log_every}).")
        from flaxchat.profiling import parse_steps
        from flaxchat.trackers import check_trackers
        check_trackers(self.tracker)  # a missing library is one sentence now, not after the model is built
        parse_steps(self.profile_steps)
        check_bookkeeping(self.keep_checkpoints, save_every=self.save_every, eval_every=self.eval_every, **every)


@dataclasses.dataclass(frozen=True)
class TrainConfig(RunConfig):
    """Everything about a pretraining run except the model shape. Flags: --kebab-case of each field."""

    data: str = flag("stories", "'stories' (built-in, offline), a path/glob of .txt/.jsonl/.parquet, or "
                                "hf:owner/dataset")
    text_field: str = flag("text", "the .jsonl field or parquet column that holds the text (a hub --data sets it with "
                                   "?field=)")
    depth: int = flag(4, "the one dial: layers; width = 64 x depth")
    sequence_len: int = flag(256, "tokens per row (the context the model trains on)")
    vocab_size: int = flag(4096, "tokenizer vocabulary, trained on --data when --tokenizer-dir has none")
    window_pattern: str = flag("SSSL", "attention windows tiled over the layers: S = a quarter of the context, L = all "
                                       "of it (the last layer is always L)")
    param_data_ratio: float = flag(12.0, "training tokens per scaling parameter (block matrices + LM head) when "
                                         "--steps is -1")  # nanochat's
    device_batch_size: int = flag(8, "rows per micro-batch per device")
    total_batch_size: int = flag(-1, "tokens per optimizer step (gradient accumulation fills it); -1: nanochat's "
                                     "automatic size, 2^19 x (D/D_ref)^0.383 rounded to a power of two (D: this run's "
                                     "horizon, D_ref: d12's)")
    optimizer: str = flag("muon", "muon (Muon for the block matrices + AdamW groups, nanochat's) or adamw (AdamW "
                                  "everywhere)")
    matrix_lr: float = flag(LR["matrix_lr"], "Muon LR at 2^19 tokens/step; every LR is scaled by sqrt(B/2^19) "
                                             "(nanochat; see --lr-batch-scaling)")
    embedding_lr: float = flag(LR["embedding_lr"], "token-embedding AdamW LR at d_model 768 and 2^19 tokens/step "
                                                   "(scaled by width and batch)")
    unembedding_lr: float = flag(LR["unembedding_lr"], "LM-head AdamW LR at d_model 768 and 2^19 tokens/step (scaled "
                                                       "by width and batch)")
    scalar_lr: float = flag(LR["scalar_lr"], "per-layer scalar AdamW LR at 2^19 tokens/step (scaled by batch)")
    weight_decay: float = flag(LR["weight_decay"], "Muon's cautious weight decay at d12 and 2^19 tokens/step; scaled "
                                                   "by sqrt(B/B_ref) x D_ref/D, cosine to 0")
    adam_beta1: float = flag(0.8, "AdamW beta1 of the embedding, LM-head and scalar groups")
    adam_beta2: float = flag(0.95, "AdamW beta2 of the scalar groups")
    # "2 times or more" is flaxchat.recipe.REPEAT_PASSES
    lr_batch_scaling: str = flag("auto", "scale every LR by sqrt(total batch / 2^19) as nanochat does: on, off, or "
                                         "auto (on with the automatic --total-batch-size -1, and with a batch you "
                                         "give when the run reads its training text 2 times or more, where the LRs as "
                                         "given memorise it; off below that, where the rule's 16-22x smaller LRs at "
                                         "1-2K-token steps made val bpb worse; docs/recipe.md)")
    warmup_steps: int = flag(40, "LR warmup steps")
    warmdown_ratio: float = flag(0.65, "fraction of the steps over which the LR falls linearly to --final-lr-frac")
    final_lr_frac: float = flag(0.05, "LR at the end of the warmdown, as a fraction of the peak")
    # auto is the backend's PolarExpress record's (flaxchat.kernels); `bench.train_throughput --phases` measures them
    ns_dtype: str = flag("auto", "Muon's orthogonalisation (Polar Express): auto (bf16 on TPU/GPU; on a CPU with bf16 "
                                 "dot instructions bf16-operands on AMD and bf16-products on Intel, fp32 elsewhere), "
                                 "float32, bfloat16, bf16-products (fp32, with two of its three products from bf16 "
                                 "operands; rectangular matrices in the fp32 Gram form) or bf16-operands (as "
                                 "bf16-products, with every product that reads the iterate from bf16 operands); see "
                                 "docs/cpu.md")
    eval_tokens: int = flag(65_536, "validation tokens per evaluation")
    sample_every: int = flag(500, "steps between sampled stories (0: none during training; the end always samples)")
    grad_checkpoint: bool = flag(False, "recompute each block's activations in the backward (less memory, more "
                                        "compute)")
    scan_layers: bool = flag(False, "run the layers that repeat (4 per period with SSSL) under one lax.scan, so the "
                                    "compiler compiles those blocks once, not once per layer (docs/accelerators.md); "
                                    "same parameters and checkpoints")
    attention: str = flag("auto", "attention kernel: auto (splash on TPU, cudnn on GPU, blockwise on CPU), blockwise, "
                                  "xla, splash, cudnn")
    init_from: str = flag("", "start from these weights (model.pkl, weights.npz or a run folder); ignored when "
                              "resuming")
    tokenizer_dir: str = flag("", "a trained tokenizer to use (default: <run-dir>/tokenizer, trained on --data if "
                                  "absent)")
    max_chars_tokenizer: int = flag(20_000_000, "characters of --data the tokenizer is trained on")
    num_samples: int = flag(3, "stories sampled at each --sample-every and at the end")
    # Pretraining's own words for some of every run's flags.
    tracker: str = flag(RunConfig.tracker, "where the metrics also go: wandb, tensorboard, none, or a comma list "
                                           "(flaxchat.trackers)")
    run_name: str = flag(RunConfig.run_name, "the trackers' name of the run (default: the run folder's name)")
    profile_steps: str = flag(RunConfig.profile_steps, "A:B: a jax.profiler trace of steps A..B-1 into <run>/profile")

    def validate(self) -> None:
        if self.optimizer not in ("muon", "adamw"):
            raise UserError(f"--optimizer must be 'muon' or 'adamw' (got {self.optimizer!r}).")
        if self.lr_batch_scaling not in ("auto", "on", "off"):
            raise UserError(f"--lr-batch-scaling must be auto, on or off (got {self.lr_batch_scaling!r}).")
        self.validate_run(sample_every=self.sample_every)
        if self.attention not in ATTENTION_NAMES:
            raise UserError(f"--attention must be one of {', '.join(ATTENTION_NAMES)} (got {self.attention!r}).")
        if self.attention == "splash" and self.sequence_len % 128:
            raise UserError(f"--attention splash needs a --sequence-len that is a multiple of 128 (got {self.sequence_len}).")
        if self.ns_dtype not in NS_DTYPES:
            raise UserError(f"--ns-dtype must be one of {', '.join(NS_DTYPES)} (got {self.ns_dtype!r}).")
        if self.device_batch_size <= 0 or self.sequence_len <= 1:
            raise UserError("--device-batch-size must be positive and --sequence-len at least 2.")
        if self.warmup_steps < 0 or not 0 <= self.warmdown_ratio <= 1 or not 0 <= self.final_lr_frac <= 1:
            raise UserError("--warmup-steps must be 0 or more, and --warmdown-ratio and --final-lr-frac between 0 and 1.")
        if self.depth <= 0:
            raise UserError(f"--depth must be at least 1 (got {self.depth}).")
        if self.steps == 0 or self.steps < -1:
            raise UserError(f"--steps must be positive, or -1 to derive them from --param-data-ratio (got {self.steps}).")
        if self.total_batch_size == 0 or self.total_batch_size < -1:
            raise UserError("--total-batch-size must be positive, or -1 for nanochat's automatic size "
                            f"(got {self.total_batch_size}).")
        lrs = dict(matrix_lr=self.matrix_lr, embedding_lr=self.embedding_lr, unembedding_lr=self.unembedding_lr,
                   scalar_lr=self.scalar_lr, weight_decay=self.weight_decay)
        for name, value in lrs.items():
            if not math.isfinite(value) or value < 0:  # a negative rate climbs the loss; nan trains to nan
                raise UserError(f"--{name.replace('_', '-')} must be 0 or more and finite (got {value}).")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise UserError(f"--adam-beta1 and --adam-beta2 must lie in [0, 1) (got {self.adam_beta1}, {self.adam_beta2}).")
        if not (math.isfinite(self.param_data_ratio) and self.param_data_ratio > 0):
            raise UserError(f"--param-data-ratio must be positive (got {self.param_data_ratio}).")
        if self.eval_tokens < 1 or self.num_samples < 0:
            raise UserError("--eval-tokens must be at least 1 and --num-samples 0 or more.")
        if not self.window_pattern or set(self.window_pattern.upper()) - {"S", "L"}:
            raise UserError(f"the window pattern {self.window_pattern!r} (--window-pattern) may only contain the "
                            "letters S (short) and L (long), e.g. SSSL.")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --- dataclass <-> argparse --------------------------------------------------------------------

def _field_type(cls, field: dataclasses.Field):
    hints = typing.get_type_hints(cls)
    tp = hints[field.name]
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def flag_help(cls, name: str) -> str:
    """The --help text of `cls`'s field `name`: that of the first class along the MRO whose field of
    that name has one (a field redefined with only a new default keeps its parent's), else ''."""
    for c in cls.__mro__:
        f = getattr(c, "__dataclass_fields__", {}).get(name)
        if f is not None and "help" in f.metadata:
            return f.metadata["help"]
    return ""


def add_dataclass_args(parser: argparse.ArgumentParser, cls, defaults: Mapping[str, Any] | None = None) -> None:
    """Add one --kebab-case flag per field of `cls`, its help from the field (`flag`); `defaults`
    overrides the dataclass defaults."""
    defaults = dict(defaults or {})
    for f in dataclasses.fields(cls):
        option = "--" + f.name.replace("_", "-")
        default = defaults.get(f.name, f.default)
        tp = _field_type(cls, f)
        text = flag_help(cls, f.name) + f" (default: {default!r})"
        if tp is bool:
            parser.add_argument(option, action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            parser.add_argument(option, type=tp, default=default, help=text, metavar=f.name.upper())


def dataclass_from_args(cls, args: argparse.Namespace):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def parse_config(cls, argv, *, prog: str, description: str | None, defaults: Mapping[str, Any] | None = None):
    """A script's config dataclass from its command line (one --kebab-case flag per field), validated."""
    parser = ArgumentParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(parser, cls, defaults)
    cfg = dataclass_from_args(cls, parser.parse_args(argv))
    cfg.validate()
    return cfg


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as a UserError (one sentence, exit 2) instead of exiting."""

    def error(self, message):
        raise UserError(f"{message} (see --help).")

