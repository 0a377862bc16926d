"""The skeleton the stages after pretraining (SFT, RL) share, so that each script reads as its own
recipe: compute init, the run folder through `flaxchat.paths` (local or `gs://`), resume or
`--fresh`, the model and optimizer born on the mesh by the same sharding rules as pretraining
(`--sharding dp|fsdp|auto`, `sharding.create_sharded`), the base weights restored into those
sharded arrays, the optimizer built by keyword from the one set of LR defaults
(`flaxchat.config.LR`, read back from the pretraining run), loader states resharded when the
device count changed, the progress file every process writes, and the report/`COMPLETE` tail.

A stage reads its starting weights from `base` (a run folder, never written to) and writes to its
own `run_dir`: checkpoints, a copy of the tokenizer, metrics, report, so that `load_model(run_dir)`
and the chat scripts open the result like any run.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable

from flaxchat.config import RunConfig, check_sharding, flag
from flaxchat.errors import UserError


@dataclasses.dataclass(frozen=True)
class StageConfig(RunConfig):
    """What SFT and RL share beyond every run's flags (`RunConfig`): the base run they start from
    and the fraction of its learning rates they train at. It words some of every run's flags for
    these stages; each stage describes --base and --lr-frac itself."""

    run_dir: str = flag(RunConfig.run_dir, "this stage's own run folder (local or gs://): checkpoints, tokenizer "
                                           "copy, report, metrics (resumed if present)")
    steps: int = flag(RunConfig.steps, "optimizer steps")
    save_every: int = flag(RunConfig.save_every, "steps between checkpoints (0: only the last step; it is always "
                                                 "saved)")
    seed: int = flag(RunConfig.seed, "seed of the data order and the sampling")
    sharding: str = flag(RunConfig.sharding, "dp (replicated parameters), fsdp (parameters, gradients and optimizer "
                                             "state split), auto: the same rules as pretraining")
    fresh: bool = flag(RunConfig.fresh, "start at step 0 even if --run-dir has a checkpoint (the old one is moved "
                                        "aside, not deleted)")
    base: str = ""  # the base model's run folder (required; only read)
    lr_frac: float = 1.0  # times the pretraining learning rates

    def validate_stage(self, what: str) -> None:
        """Every run's checks, then the base (`what` names the model it must be) and the LR fraction."""
        if not self.base:
            raise UserError(f"--base is required: the run folder of {what}.")
        self.validate_run()
        if not (math.isfinite(self.lr_frac) and self.lr_frac > 0):
            raise UserError(f"--lr-frac must be positive and finite (got {self.lr_frac}).")


@dataclasses.dataclass(frozen=True)
class StageOptim:
    """How a stage trains: the pretraining run's learning rates (read from its checkpoint, else the
    defaults in `flaxchat.config.LR`) times `lr_frac` for every group, under `schedule`."""
    lr_frac: float
    warmdown_ratio: float = 1.0  # the last fraction of the steps falls linearly to 0 (1.0: all of them)
    weight_decay: float = 0.0  # pretraining's cosine schedule ends at 0; the later stages keep it there
    from_base_optimizer: bool = False  # start from the base run's momenta and Adam moments (chat_sft)


@dataclasses.dataclass
class Stage:
    compute: Any
    model: Any
    tokenizer: Any
    optimizer: Any
    schedule: Any
    checkpointer: Any
    progress: Any
    step: int  # where training continues: 0, or the resumed checkpoint's step
    meta: dict | None  # the resumed checkpoint's meta (None when starting)
    base_meta: dict  # the meta of the checkpoint the stage started from
    run_dir: str
    base_lrs: dict  # the pretraining LRs this stage scales; saved, so that the next stage reads them too

    @property
    def folder(self):
        """This stage's run folder (`flaxchat.paths.RunFolder`): where each file it writes goes."""
        from flaxchat.paths import RunFolder
        return RunFolder(self.run_dir)

    def save(self, step: int, **meta) -> None:
        self.checkpointer.save(step, self.model, self.optimizer,
                               dict(meta, model_config=self.model.config.to_dict(), optim_config=self.base_lrs,
                                    tokenizer=self.tokenizer.fingerprint()))

    def metrics_log(self, cfg: "StageConfig"):
        """metrics.jsonl, every line of which also goes to the `--tracker`s (W&B, TensorBoard)."""
        import dataclasses as dc

        from flaxchat.report import MetricsLog
        from flaxchat.trackers import open_trackers
        return MetricsLog(self.folder.metrics, trackers=open_trackers(
            cfg.tracker, self.run_dir, stage=self.progress.stage, run_name=cfg.run_name, config=dc.asdict(cfg),
            start_step=self.step, fresh=cfg.fresh, is_main=self.compute.is_main))

    def loop(self, cfg: "StageConfig", steps: int, trainer, save, meter):
        """The stage's `flaxchat.loop.Loop` from its step on: its checkpointer, progress file, the
        stop notice's grace and the `--profile-steps` window."""
        from flaxchat import paths
        from flaxchat.common import print0
        from flaxchat.loop import Loop
        from flaxchat.profiling import StepProfiler
        c = self.compute
        profile = StepProfiler(cfg.profile_steps, paths.join(self.run_dir, "profile"), start_step=self.step,
                               log=print0, is_main=c.is_main, process=c.process_index, processes=c.process_count)
        return Loop(self.progress.stage, steps, start=self.step, trainer=trainer, save=save, checkpointer=self.checkpointer,
                    progress=self.progress, meter=meter, log=print0, processes=c.process_count,
                    grace_s=cfg.preempt_grace, announce_compile=False, profile=profile)

    def loader_states(self, streams: list[int]) -> list | None:
        """The resumed checkpoint's loader states for this job's streams, resharded when the job
        has another device count than the run that saved them (None when starting)."""
        states = (self.meta or {}).get("loader_states")
        if not states:
            return None
        count = self.compute.device_count
        if len(states) != count:
            self.log(f"data: the checkpoint has {len(states)} data reader(s), this job {count}; resharding")
            states = reshard_conversation_states(states, count)
        return [states[s] for s in streams]

    def log(self, msg: str) -> None:
        from flaxchat.common import print0
        print0(msg)

    def finish(self, summary: dict, report: Callable[[], None] | None = None) -> dict:
        """The tail every stage ends with (`flaxchat.stage.finish`): the last progress line, the
        report, then `COMPLETE`."""
        from flaxchat.stage import finish
        return finish(self.run_dir, self.compute.is_main, self.checkpointer, self.progress, self.step, summary, report)


def reshard_conversation_states(states: list[dict], count: int) -> list[dict]:
    """Conversation loaders read their own stride of one shuffled order. With another number of
    streams every new stream continues from the furthest point of that order any old stream reached:
    nothing is trained twice; what the old streams had buffered or not yet reached is skipped."""
    furthest = max(states, key=lambda s: (int(s["epoch"]), int(s["cursor"])))
    return [{"epoch": int(furthest["epoch"]), "cursor": int(furthest["cursor"]) * len(states) // count,
             "buffer": []} for _ in range(count)]


def check_folders(base: str, run_dir: str) -> None:
    """Fail before any work when the base is missing or the stage would write into it."""
    from flaxchat import paths
    from flaxchat.loading import resolve
    found = resolve(base)

    def same(a: str, b: str) -> bool:
        if paths.is_remote(a) or paths.is_remote(b):
            return a.rstrip("/") == b.rstrip("/")
        return os.path.realpath(a) == os.path.realpath(b)
    if same(run_dir, found.run_dir):
        raise UserError(f"--run-dir {run_dir} is the base model's own folder; give the stage a folder of its own "
                        "so the base checkpoint is never overwritten.")


def base_learning_rates(base_meta: dict) -> dict:
    """The pretraining run's LRs as it ran them (its `optim_config`, with the batch scale), else
    the flags it was given, else the defaults: what a later stage multiplies by its fraction."""
    from flaxchat.config import LR
    saved = dict(base_meta.get("optim_config") or {})
    if saved:
        return {k: saved[k] for k in (*LR, "batch_lr_scale") if k in saved}
    given = base_meta.get("train_config") or {}
    return {k: given.get(k, v) for k, v in LR.items()}


def open_stage(base: str, run_dir: str, *, name: str, steps: int, optim: StageOptim, dtype: str = "auto",
               sharding: str = "auto", fresh: bool = False, keep: int = 2, log=print) -> Stage:
    from flax import nnx

    from flaxchat import checkpoint as ckpt
    from flaxchat import paths
    from flaxchat.common import compute_init
    from flaxchat.gpt import GPT, param_count
    from flaxchat.loading import read_run, resolve
    from flaxchat.optim import OptimConfig, Schedule, make_optimizer
    from flaxchat.progress import Progress
    from flaxchat.stage import open_run, place

    check_sharding(sharding)
    check_folders(base, run_dir)
    paths.check_writable(run_dir)
    compute = compute_init(dtype)
    cfg, tokenizer, base_meta = read_run(base)
    tokenizer.check_matches(base_meta.get("tokenizer"), f"the checkpoint of --base {base}",
                            "put back the tokenizer folder that run was trained with.")
    ckpt_dir = paths.RunFolder(run_dir).checkpoints
    checkpointer, resume, meta = open_run(run_dir, name=name, fresh=fresh, keep=keep, compute=compute, model_cfg=cfg,
                                          tokenizer=tokenizer, log=log,
                                          fix="resume from the --base it started from, or use --fresh or another --run-dir.")
    if compute.is_main:
        with paths.local_copy(paths.RunFolder(run_dir).tokenizer) as local:
            tokenizer.save(local)

    # --- optimizer: the pretraining LRs x lr_frac, chat_sft's momentum, no weight decay schedule --
    lrs = base_learning_rates(base_meta)
    schedule = Schedule(max(steps, 1), warmup_steps=0, warmdown_ratio=optim.warmdown_ratio, final_lr_frac=0.0,
                        momentum="finetune", weight_decay="constant")
    ns_dtype = compute.polar.ns_dtype  # bf16 on TPU/GPU; on a CPU by its bf16 dot instructions
    opt_cfg = OptimConfig(**{k: v for k, v in lrs.items() if k != "weight_decay"}, weight_decay=optim.weight_decay,
                          n_embd=cfg.n_embd, ns_dtype=ns_dtype, lr_frac=optim.lr_frac)

    # --- placement: born sharded on the mesh, then the weights restored into those arrays -------
    new_model = lambda: GPT(cfg, rngs=nnx.Rngs(0), dtype=compute.compute_dtype, kernels=compute.kernels)
    model, optimizer, compute, layout = place(compute, sharding, new_model,
                                              lambda m: make_optimizer(m, opt_cfg, schedule, compute.polar),
                                              param_count(nnx.eval_shape(new_model)))
    step = 0
    if meta is not None:
        step = checkpointer.restore(model, optimizer, resume)["step"]
        log(f"resumed from step {step} in {ckpt_dir}")
    else:
        found = resolve(base)
        base_ckpt = ckpt.open_reader(found.checkpoints)  # read-only: the base may still be training

        def start_from(at: int, _meta: dict) -> None:
            if optim.from_base_optimizer and base_meta.get("has_optimizer", True):
                try:
                    base_ckpt.restore(model, optimizer, at)
                    reset_schedules(optimizer)
                    log(f"{name}: starting from {base}'s weights and optimizer state (momenta and Adam moments; "
                        "schedules reset)")
                    return
                except UserError:
                    if not paths.isdir(base_ckpt.step_dir(at)):
                        raise  # deleted by the base run meanwhile: the next intact step is tried
                    log(f"{name}: {base} has no matching optimizer state; fresh momenta")
            base_ckpt.restore(model, None, at)

        try:
            base_ckpt.use_newest_intact(start_from, found.step, log=log)
        finally:
            base_ckpt.close()
    shown = ", ".join(f"{k} {v:g}" for k, v in lrs.items() if k != "weight_decay")
    log(f"{name}: {layout} over {compute.device_count} device(s); LRs {shown} x {optim.lr_frac}; "
        f"weight decay {optim.weight_decay:g}")
    progress = Progress(name, steps=steps, process=compute.process_index, run_dir=run_dir)
    progress.update(step, force=True)
    return Stage(compute, model, tokenizer, optimizer, schedule, checkpointer, progress, step, meta, base_meta,
                 run_dir, lrs)


def reset_schedules(optimizer) -> None:
    """Start every schedule of a restored optimizer at step 0 (chat_sft keeps the momenta but resets
    the LRs): the step counts of the LR schedules and of Muon go to 0; Adam's own count stays, so
    its bias correction still matches its moments."""
    import jax.numpy as jnp
    from flax import nnx
    state = nnx.state(optimizer, nnx.optimizer.OptState)
    for path, var in nnx.to_flat_state(state):
        adam_count = len(path) >= 2 and path[-1] == "count" and path[-2] == 0
        if (path[-1] == "count" and not adam_count) or path == ("step",):
            var.set_value(jnp.zeros_like(var.get_value()))
    nnx.update(optimizer, state)
