"""Supervised finetuning: teach a base model to chat, on conversations rendered with the chat template.

    python -m scripts.sft --base runs/d4 --run-dir runs/d4-sft
    python -m scripts.sft --base runs/d4 --mix "chat:2,spelling,arithmetic,smoltalk@data/smoltalk.parquet"

Only what the assistant writes trains (its text, its tool calls, <|assistant_end|>); user turns and
tool outputs do not. Whole conversations are packed into rows best-fit from a buffer, padding
instead of cropping, and the step is the same jitted train step as pretraining. The recipe is
nanochat's chat_sft: the optimizer starts from the pretraining run's momenta and Adam moments
(schedules reset), every learning rate is the pretraining run's times --lr-frac 0.8, constant for
the first half of the steps, then falling linearly to 0; no weight decay (pretraining's cosine
ends at 0). flaxchat differs in one point: the LRs it reads back are the ones pretraining ran
with, batch scaling included (nanochat reads the unscaled flags). The base run folder is only
read; this stage writes its own (local or gs://), and a re-run resumes from its checkpoint (the
next row, the same optimizer state).
"""

from __future__ import annotations

import functools
import dataclasses
import math
import sys
import time

from flaxchat.config import flag, parse_config
from flaxchat.errors import UserError, cli_main
from flaxchat.finetune import StageConfig
from flaxchat.kernels import tune_process

CHECK_PROMPTS = ["Who are you?", "Sam has 12 apples and buys 7 more. How many apples does Sam have now?"]


@dataclasses.dataclass(frozen=True)
class SFTConfig(StageConfig):
    run_dir: str = "runs/sft"
    steps: int = flag(StageConfig.steps, "optimizer steps; -1 derives them from --epochs")
    base: str = flag(StageConfig.base, "run folder (or checkpoint) of the model to finetune; only read")
    mix: str = flag("chat,spelling,spell,arithmetic", "tasks and weights, e.g. 'chat:2,spelling,arithmetic' or "
                                                      "'gsm8k@data/gsm8k.parquet'")  # name[@path][:weight],...
    val_mix: str = flag("", "tasks for the validation loss (default: --mix, on the validation split)")
    epochs: float = flag(1.0, "passes over the mixture when --steps is -1")
    device_batch_size: int = flag(8, "rows per micro-batch per device (whole conversations packed into each)")
    grad_accum: int = flag(1, "micro-batches per optimizer step")
    # chat_sft's: its init_lr_frac, the last half of the steps falling to 0, the pretraining momenta
    # and Adam moments
    lr_frac: float = flag(0.8, "every group's LR is the pretraining run's times this (chat_sft: 0.8)")
    warmdown_ratio: float = flag(0.5, "the last fraction of the steps over which the LR falls linearly to 0")
    weight_decay: float = flag(0.0, "Muon's weight decay")
    from_base_optimizer: bool = flag(True, "start from the base run's optimizer state (momenta, Adam moments; "
                                           "schedules reset)")
    eval_every: int = flag(100, "steps between validation losses (0: none)")
    eval_batches: int = flag(8, "validation batches per evaluation")
    save_every: int = 200

    def validate(self) -> None:
        self.validate_stage("the model to finetune (e.g. runs/d4)")
        if min(self.device_batch_size, self.grad_accum, self.eval_batches) < 1:
            raise UserError("--device-batch-size, --grad-accum and --eval-batches must be at least 1.")
        if self.steps == 0 or self.steps < -1 or self.epochs <= 0:
            raise UserError("--steps must be positive (or -1 for --epochs passes) and --epochs positive.")
        if not 0 <= self.warmdown_ratio <= 1 or self.weight_decay < 0:
            raise UserError("--warmdown-ratio must lie between 0 and 1 and --weight-decay be 0 or more.")


def parse_args(argv, defaults=None) -> SFTConfig:
    return parse_config(SFTConfig, argv, prog="python -m scripts.sft", description=__doc__, defaults=defaults)


def main(argv=None, tune=False) -> int:
    cfg = parse_args(argv)
    if tune:  # after the flags, so that --help and a bad flag answer without JAX
        tune_process()
    run(cfg)
    return 0


def run(cfg: SFTConfig) -> dict:
    """Run SFT; the mesh it sets is undone when it returns (run_chat runs the stages in one process)."""
    from flaxchat.common import mesh_scope
    with mesh_scope():
        return _run(cfg)


def _run(cfg: SFTConfig) -> dict:
    import jax.numpy as jnp

    import tasks
    from flaxchat.chat_data import ConversationLoader, trained_fraction
    from flaxchat import paths
    from flaxchat.common import fmt_duration, gather_streams, global_batch, local_streams, print0
    from flaxchat.data.loader import LoaderGroup
    from flaxchat.finetune import StageOptim, open_stage
    from flaxchat.loop import Meter
    from flaxchat.report import plot_losses, write_report
    from flaxchat.stage import already_complete, complete_line
    from flaxchat.train import StepLoop, loss_sum

    t_start = time.time()
    # --- tasks first: a bad mixture fails before any model is loaded -------------------------
    train_set = tasks.parse_mix(cfg.mix, seed=cfg.seed, split="train")
    val_set = tasks.parse_mix(cfg.val_mix or cfg.mix, seed=cfg.seed, split="val")
    print0(f"data: {len(train_set):,} training conversations ({cfg.mix}), {len(val_set):,} for validation")

    # --- model, tokenizer, optimizer (resumed when the run folder has a checkpoint) ----------
    if cfg.steps > 0:
        steps = cfg.steps
    else:
        import jax
        from flaxchat.loading import read_run
        model_cfg, tok, _ = read_run(cfg.base)
        rows_per_step = cfg.device_batch_size * jax.device_count() * cfg.grad_accum
        per_row = conversations_per_row(train_set, tok, model_cfg.sequence_len, cfg.seed)
        steps = max(1, math.ceil(cfg.epochs * len(train_set) / (per_row * rows_per_step)))
    stage = open_stage(cfg.base, cfg.run_dir, name="sft", steps=steps, fresh=cfg.fresh, dtype=cfg.dtype,
                       sharding=cfg.sharding, keep=cfg.keep_checkpoints, log=print0,
                       optim=StageOptim(lr_frac=cfg.lr_frac, warmdown_ratio=cfg.warmdown_ratio,
                                        weight_decay=cfg.weight_decay, from_base_optimizer=cfg.from_base_optimizer))
    done = already_complete(cfg.run_dir, stage.step, steps)
    if done is not None:  # a rerun of a finished run: its record stays as the run that trained wrote it
        stage.checkpointer.close()
        print0(complete_line(cfg.run_dir, stage.step))
        return dict(done, is_main=stage.compute.is_main, already_complete=True)
    model, tokenizer, compute = stage.model, stage.tokenizer, stage.compute
    T = model.config.sequence_len
    streams = local_streams(compute)
    loaders = [ConversationLoader(train_set, tokenizer, cfg.device_batch_size, T, seed=cfg.seed, stream=s,
                                  streams=compute.device_count) for s in streams]
    for state, loader in zip(stage.loader_states(streams) or [], loaders):
        loader.load_state_dict(state)
    rows = cfg.device_batch_size * compute.device_count
    print0(f"batch: {cfg.grad_accum} micro-batch(es) of {rows} x {T} tokens per step; {steps} steps")

    batches = LoaderGroup(loaders, cfg.grad_accum)
    trained = {}  # the fraction of the last batch's tokens that train (the assistant's)

    def train_one(at):
        x, y = batches.next_batch()  # (grad_accum, local rows, T)
        trained["fraction"] = trained_fraction(y)
        return trainer(global_batch(compute, x), global_batch(compute, y))

    val_batches = []  # the same validation batches at every evaluation: packed once, on first use
    val = {}  # the first and the last validation loss

    def val_loss(at):
        if not val_batches:
            loader = ConversationLoader(val_set, tokenizer, cfg.device_batch_size, T, seed=cfg.seed)
            val_batches.extend(loader.next_batch() for _ in range(cfg.eval_batches))
        total = count = 0.0
        for x, y in val_batches:
            nats, n = loss_sum(model, jnp.asarray(x), jnp.asarray(y))
            total, count = total + float(nats), count + float(n)
        val["last"] = total / max(count, 1.0)
        val.setdefault("first", val["last"])
        print0(f"step {at:05d} | val loss {val['last']:.4f}")
        if compute.is_main:
            metrics.append(kind="val", step=at, val_loss=val["last"])

    def save(at):
        states = gather_streams(dict(zip(streams, batches.state_dict())), compute.device_count)
        stage.save(at, sft_config=dataclasses.asdict(cfg), loader_states=states, base=paths.absolute(cfg.base),
                   stage="sft")

    def log_line(at):
        lossf, r = meter.loss(at, loop.loss, "lower --lr-frac."), meter.read(at)
        print0(f"step {at:05d}/{steps:05d} | loss {lossf:.4f} | trained tokens {100 * trained['fraction']:.0f}% | "
               f"epoch {loaders[0].epochs_done:.2f} | tok/s {r.tok_s:,.0f} | eta {r.eta}")
        if compute.is_main:
            metrics.append(kind="train", step=at, loss=lossf, tok_per_s=r.tok_s,
                           lrm=float(stage.schedule.lr_multiplier(at - 1)), time=time.time())

    # --- training loop ---------------------------------------------------------------------------
    metrics = stage.metrics_log(cfg)  # --tracker: W&B/TensorBoard get every line too
    trainer = StepLoop(model, stage.optimizer, plan=compute.plan)
    meter = Meter(steps, tokens_per_step=cfg.grad_accum * rows * T, smoothing=0.8)
    loop = stage.loop(cfg, steps, trainer, save, meter)
    loop.every(cfg.log_every, log_line)
    loop.every(cfg.eval_every, val_loss, last=cfg.eval_every > 0, first=cfg.eval_every > 0)
    loop.every(cfg.save_every, loop.save)
    step = stage.step = loop.run(train_one)
    smooth, first_val, last_val, train_seconds = meter.smooth, val.get("first"), val.get("last"), meter.trained_s

    # --- a look at the result, report ---------------------------------------------------------------
    replies = check_replies(model, tokenizer, CHECK_PROMPTS)
    summary = dict(step=step, steps=steps, final_loss=smooth, val_loss=last_val, first_val_loss=first_val,
                   train_seconds=train_seconds, run_dir=paths.absolute(cfg.run_dir))

    def report():
        for prompt, reply in replies.items():
            print0(f"> {prompt}\n{reply}\n")
        metrics.note(kind="sample", step=step, samples=[f"> {p}\n{r}" for p, r in replies.items()])
        png = plot_losses(metrics.read(), stage.folder.loss_plot, f"SFT on {cfg.mix}",
                          val_key="val_loss", val_label="val loss (nats/token)")
        write_report(stage.folder.report, title="flaxchat SFT", sections=[
            ("Run", {"base": paths.absolute(cfg.base), "mix": cfg.mix, "conversations": len(train_set),
                     "steps": steps, "rows per step": rows * cfg.grad_accum, "sequence": T,
                     "val loss": f"{first_val:.4f} -> {last_val:.4f}" if last_val is not None else "- (--eval-every=0)",
                     "training time": fmt_duration(train_seconds)}),
            ("Loss curve", "![loss](loss.png)" if png else "(no steps logged)"),
            ("Replies (greedy)", [f"{p} -> {r!r}" for p, r in replies.items()]),
            ("Config", dataclasses.asdict(cfg)),
        ])
        val = f"val loss {last_val:.4f}" if last_val is not None else "no validation (--eval-every=0)"
        print0(f"done: {step} steps in {fmt_duration(time.time() - t_start)}; {val}; "
               f"report {stage.folder.report}")
        metrics.close()  # the trackers: process 0 only, as is this report

    stage.finish(summary, report)
    return dict(summary, replies=replies)


def conversations_per_row(dataset, tokenizer, seq_len: int, seed: int, probe_rows: int = 64) -> float:
    """How many conversations the packing fits in a row, measured on the first rows of the order."""
    from flaxchat.chat_data import ConversationLoader
    probe = ConversationLoader(dataset, tokenizer, probe_rows, seq_len, seed=seed)
    probe.next_batch()
    used = probe.epoch * len(dataset) + probe.cursor - len(probe.buffer)
    return max(used, 1) / probe_rows


def check_replies(model, tokenizer, prompts: list[str], max_tokens: int = 64) -> dict[str, str]:
    """Greedy replies to a few prompts, with the tool on: what a user of the chat CLI would see.
    A prompt longer than the model's context is not asked (a look at the result must not fail the
    stage after its training is done)."""
    from flaxchat.engine import Engine
    from flaxchat.loading import chat_prompt
    engine = Engine(model, tokenizer)
    context = model.config.sequence_len
    out = {}
    for p in prompts:
        ids = chat_prompt(tokenizer, [{"role": "user", "content": p}])
        if len(ids) >= context:
            out[p] = f"(not asked: {len(ids)} tokens, the model's context holds {context})"
            continue
        samples, _ = engine.generate_batch(ids, 1, max_tokens, temperature=0.0)
        out[p] = tokenizer.decode(samples[0])
    return out


if __name__ == "__main__":
    sys.exit(cli_main(functools.partial(main, tune=True)))
