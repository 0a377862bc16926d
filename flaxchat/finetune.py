"""What the stages after pretraining (SFT, RL) share: open the model they start from, make or
resume their own run folder, and build the optimizer, all on the same mesh as pretraining.

A stage reads its starting weights from `base` (a run folder, never written to) and writes to its
own `run_dir`: checkpoints (resumed when present, moved aside with `fresh`), a copy of the
tokenizer, so that `load_model(run_dir)` and the chat scripts open the result like any run.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from flaxchat.errors import UserError


# --help of the flags every stage has.
STAGE_HELP = {
    "run_dir": "this stage's own run folder: checkpoints, tokenizer copy, report, metrics (resumed if present)",
    "steps": "optimizer steps",
    "lr_frac": "fraction of the pretraining learning rates; decays linearly to 0",
    "save_every": "steps between checkpoints (0: only the last step; it is always saved)",
    "keep_checkpoints": "how many checkpoints to keep",
    "log_every": "steps between progress lines",
    "seed": "seed of the data order and the sampling",
    "dtype": "compute dtype: auto (bf16 on TPU/GPU, fp32 on CPU), float32, bfloat16",
    "fresh": "start at step 0 even if --run-dir has a checkpoint (the old one is moved aside, not deleted)",
}


@dataclasses.dataclass
class Stage:
    compute: Any
    model: Any
    tokenizer: Any
    optimizer: Any
    schedule: Any
    checkpointer: Any
    step: int  # where training continues: 0, or the resumed checkpoint's step
    meta: dict | None  # the resumed checkpoint's meta (None when starting)
    base_meta: dict  # the meta of the checkpoint the stage started from

    def save(self, step: int, **meta) -> None:
        self.checkpointer.save(step, self.model, self.optimizer,
                               dict(meta, model_config=self.model.config.to_dict()))


@dataclasses.dataclass(frozen=True)
class StageOptim:
    """The pretraining learning rates times `lr_frac`, decayed linearly to 0 over the stage."""
    lr_frac: float = 0.3
    matrix_lr: float = 0.02
    embedding_lr: float = 0.3
    unembedding_lr: float = 0.004
    scalar_lr: float = 0.5
    weight_decay: float = 0.0
    warmup_ratio: float = 0.0


def check_folders(base: str, run_dir: str) -> None:
    """Fail before any work when the base is missing or the stage would write into it."""
    from flaxchat.loading import resolve
    paths = resolve(base)
    if Path(run_dir).expanduser().resolve() == paths.run_dir.resolve():
        raise UserError(f"--run-dir {run_dir} is the base model's own folder; give the stage a folder of its own "
                        "so the base checkpoint is never overwritten.")


def open_stage(base: str, run_dir: str, *, steps: int, optim: StageOptim, dtype: str = "auto",
               fresh: bool = False, keep: int = 2, log=print) -> Stage:
    import jax
    from flax import nnx

    from flaxchat import checkpoint as ckpt
    from flaxchat import sharding
    from flaxchat.common import compute_init
    from flaxchat.config import GPTConfig
    from flaxchat.loading import load_model
    from flaxchat.optim import OptimConfig, Schedule, build_optimizer

    check_folders(base, run_dir)
    compute = compute_init(dtype)
    model, tokenizer, base_meta = load_model(base)
    os.makedirs(run_dir, exist_ok=True)
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if fresh and compute.is_main:
        moved = ckpt.set_aside(ckpt_dir)
        if moved:
            log(f"--fresh: moved the existing checkpoints to {moved}")
    checkpointer = ckpt.Checkpointer(ckpt_dir, max_to_keep=keep)
    resume = checkpointer.latest_step()
    meta = checkpointer.read_meta(resume) if resume is not None else None
    if meta is not None and GPTConfig.from_dict(meta["model_config"]) != model.config:
        raise UserError(f"{run_dir} holds a checkpoint of a different model than {base}; "
                        "use --fresh or another --run-dir.")
    if compute.is_main:
        tokenizer.save(os.path.join(run_dir, "tokenizer"))

    cfg = model.config
    schedule = Schedule(max(steps, 1), warmup_steps=round(optim.warmup_ratio * steps),
                        warmdown_ratio=1.0 - optim.warmup_ratio, final_lr_frac=0.0, momentum="finetune",
                        weight_decay="constant")
    ns_dtype = "bfloat16" if compute.backend in ("tpu", "gpu") else "float32"
    opt_cfg = OptimConfig(matrix_lr=optim.matrix_lr, embedding_lr=optim.embedding_lr,
                          unembedding_lr=optim.unembedding_lr, scalar_lr=optim.scalar_lr,
                          weight_decay=optim.weight_decay, n_embd=cfg.n_embd, ns_dtype=ns_dtype, lr_frac=optim.lr_frac)
    optimizer = nnx.Optimizer(model, build_optimizer(opt_cfg, schedule), wrt=nnx.Param)
    compute = compute.with_sharding("dp")
    jax.set_mesh(compute.mesh)
    sharding.shard_model_and_optimizer(model, optimizer, compute.mesh)
    step = 0
    if meta is not None:
        step = checkpointer.restore(model, optimizer, resume)["step"]
        log(f"resumed from step {step} in {ckpt_dir}")
    return Stage(compute, model, tokenizer, optimizer, schedule, checkpointer, step, meta, base_meta)
