"""Reinforcement learning on problems with checkable answers (GRPO-style REINFORCE, as nanochat).

    python -m scripts.rl --base runs/d4-sft --run-dir runs/d4-rl
    python -m scripts.rl --base runs/d4-sft --task gsm8k@data/gsm8k --steps 300

Each step samples `--samples` answers to each of `--prompts` problems with the Engine (tool use on:
the model's <|python_start|> calls are evaluated and their output forced into the sample), rewards
each answer 1 if its final answer is right, and takes the group-normalised advantage
(reward - mean reward of the same problem's samples) as the weight of its sampled tokens'
log-probabilities. The policy gradient is normalised per problem, as nanochat's chat_rl does: each
problem's tokens are averaged over that problem's sampled tokens, then the problems are averaged,
so every problem weighs the same however long its answers are. Prompt tokens and tool outputs
are not trained, nor an end token the model did not sample (a <|bos|> stop, the context's end).
Rows are the model's context: a long prompt keeps its start (and its final <|assistant_start|>)
and the answer's budget is what the context leaves, so an answer is always trained whole. Every
`--eval-every` steps, pass@1 (greedy) on held-out problems is measured. A re-run resumes from the
run's checkpoint; the run folder may be local or gs://.
"""

from __future__ import annotations

import functools
import dataclasses
import sys
import time

from flaxchat.config import flag, parse_config
from flaxchat.errors import UserError, cli_main
from flaxchat.finetune import StageConfig
from flaxchat.kernels import tune_process


@dataclasses.dataclass(frozen=True)
class RLConfig(StageConfig):
    run_dir: str = "runs/rl"
    base: str = flag(StageConfig.base, "run folder of the model to improve (an SFT run); only read")
    # name[@path]: a task with a reward
    task: str = flag("arithmetic", "task to learn, e.g. arithmetic or gsm8k@data/gsm8k.parquet (train split; val "
                                   "split measures)")
    steps: int = 100
    prompts: int = flag(8, "problems per step")
    samples: int = flag(8, "answers sampled per problem; their mean reward is the baseline")  # the group
    # at most: a long prompt leaves less of the context to its answer
    max_new_tokens: int = flag(64, "longest answer sampled")
    temperature: float = flag(0.8, "sampling temperature of the answers that train")
    top_k: int = flag(50, "sample among the k likeliest tokens")
    # Muon's update has a fixed size whatever the gradient's: with 64 noisy samples a step, 0.05 of
    # the pretraining rates lowered held-out pass@1 (69% -> 50% in 50 steps); 0.01 raises it.
    lr_frac: float = flag(0.01, "every group's LR is the pretraining run's (as the SFT base read them) times this, "
                                "falling linearly to 0 over the steps (chat_rl)")
    eval_every: int = flag(50, "steps between pass@1 measurements (0: only at the start and the end)")
    eval_examples: int = flag(100, "held-out problems for pass@1 (greedy)")
    save_every: int = 50
    log_every: int = 5

    def validate(self) -> None:
        self.validate_stage("the SFT model to improve (e.g. runs/d4-sft)")
        if min(self.steps, self.prompts, self.samples, self.max_new_tokens, self.eval_examples) < 1:
            raise UserError("--steps, --prompts, --samples, --max-new-tokens and --eval-examples must be at least 1.")
        if self.samples < 2:
            raise UserError("--samples must be at least 2: the advantage compares answers to the same problem.")
        from flaxchat.engine import make_sampling
        make_sampling(self.temperature, self.top_k)  # a bad --temperature/--top-k: one sentence, before any work


def parse_args(argv) -> RLConfig:
    return parse_config(RLConfig, argv, prog="python -m scripts.rl", description=__doc__)


def main(argv=None, tune=False) -> int:
    cfg = parse_args(argv)
    if tune:  # after the flags, so that --help and a bad flag answer without JAX
        tune_process()
    run(cfg)
    return 0


def run(cfg: RLConfig) -> dict:
    """Run RL; the mesh it sets is undone when it returns (run_chat runs the stages in one process)."""
    from flaxchat.common import mesh_scope
    with mesh_scope():
        return _run(cfg)


def _run(cfg: RLConfig) -> dict:
    import numpy as np
    from flax import nnx

    from flaxchat import paths
    from flaxchat.common import fmt_duration, global_from_full, print0
    from flaxchat.engine import Engine
    from flaxchat.evaluation import generative_accuracy
    from flaxchat.finetune import StageOptim, open_stage
    from flaxchat.loop import Meter
    from flaxchat.report import plot_losses, write_report
    from flaxchat.stage import already_complete, complete_line
    from flaxchat.tools import calculate
    from flaxchat.train import StepLoop

    t_start = time.time()
    train_task, val_task = open_task(cfg.task, "train"), open_task(cfg.task, "val")
    print0(f"task: {cfg.task}: {len(train_task):,} training problems, {len(val_task):,} held out")
    stage = open_stage(cfg.base, cfg.run_dir, name="rl", steps=cfg.steps, fresh=cfg.fresh, dtype=cfg.dtype,
                       sharding=cfg.sharding, keep=cfg.keep_checkpoints, log=print0,
                       optim=StageOptim(lr_frac=cfg.lr_frac))
    done = already_complete(cfg.run_dir, stage.step, cfg.steps)
    if done is not None:  # a rerun of a finished run: its record stays as the run that trained wrote it
        stage.checkpointer.close()
        print0(complete_line(cfg.run_dir, stage.step))
        return dict(done, is_main=stage.compute.is_main, already_complete=True)
    model, tokenizer, compute = stage.model, stage.tokenizer, stage.compute
    T = model.config.sequence_len
    if cfg.samples % compute.device_count:
        raise UserError(f"--samples ({cfg.samples}) must be a multiple of the {compute.device_count} devices: each "
                        "problem's answers are one micro-batch split over them.")
    # The calculator only: a sampled call that is not arithmetic gets an error text back, never a
    # sandbox process (thousands of samples per run; the sandbox stays for chat and HumanEval).
    engine = Engine(model, tokenizer, tool_runner=lambda expr: calculate(expr) or "error: not arithmetic")
    end_id = tokenizer.encode_special("<|assistant_end|>")

    def refresh_engine():
        _, engine.params = nnx.split(model)  # the step donated the old parameter buffers

    def answer(conv, seed):
        prompt = fit_prompt(tokenizer.render_for_completion(conv), T)
        budget = min(cfg.max_new_tokens, T - len(prompt))  # prompt + answer + end token <= T + 1
        return prompt, *sample_answers(engine, prompt, cfg.samples, budget, temperature=cfg.temperature,
                                       top_k=cfg.top_k, seed=seed)

    def pass_at_1() -> float:  # greedy, on the first --eval-examples held-out problems
        return generative_accuracy(engine, tokenizer, val_task, cfg.eval_examples, max_tokens=cfg.max_new_tokens,
                                   temperature=0.0)["accuracy"]

    def rollout(step):
        """(inputs, targets, weights) of shape (prompts, samples, T), and the rewards."""
        rows, rewards = [], np.zeros((cfg.prompts, cfg.samples), np.float32)
        for j in range(cfg.prompts):
            conv = train_task[(step * cfg.prompts + j) % len(train_task)]
            prompt, outs, masks, stops = answer(conv, cfg.seed * 1_000_003 + step * cfg.prompts + j)
            rewards[j] = [train_task.reward(conv, tokenizer.decode(out)) for out in outs]
            rows.append(policy_rows(prompt, outs, masks, stops, end_id, T, tokenizer.bos_token_id))
        inputs = np.stack([r[0] for r in rows])
        targets = np.stack([r[1] for r in rows])
        adv = rewards - rewards.mean(axis=1, keepdims=True)
        return inputs, targets, policy_weights(targets, adv), rewards

    # --- loop ---------------------------------------------------------------------------------------
    metrics = stage.metrics_log(cfg)  # --tracker: W&B/TensorBoard get every line too
    evals = dict((stage.meta or {}).get("evals", {}))  # step -> pass@1, carried across resumes
    if "0" not in evals:
        evals["0"] = pass_at_1()
        print0(f"step {0:05d} | pass@1 {100 * evals['0']:.1f}% on {min(cfg.eval_examples, len(val_task))} held-out problems")
    rewards = []  # each step's mean reward since the last log line
    timing = {}

    def train_one(at):
        t0 = time.time()
        inputs, targets, weights, r = rollout(at)
        timing.update(sampling=time.time() - t0, start=t0)
        rewards.append(float(r.mean()))
        loss = trainer(*(global_from_full(compute, a) for a in (inputs, targets, weights)))
        trainer.sync()
        refresh_engine()  # the next rollout samples from the updated weights
        return loss

    def log_line(at):
        mean_r = sum(rewards) / len(rewards)
        r = meter.read(at)
        print0(f"step {at:05d}/{cfg.steps:05d} | mean reward {mean_r:.3f} | sampling {timing['sampling']:.1f}s | "
               f"step {time.time() - timing['start']:.1f}s | eta {r.eta}")
        if compute.is_main:
            metrics.append(kind="train", step=at, loss=1.0 - mean_r, reward=mean_r, time=time.time())
        rewards.clear()

    def evaluate(at):
        evals[str(at)] = pass_at_1()
        print0(f"step {at:05d} | pass@1 {100 * evals[str(at)]:.1f}%")
        if compute.is_main:
            metrics.append(kind="val", step=at, pass_at_1=evals[str(at)])

    def save(at):
        stage.save(at, rl_config=dataclasses.asdict(cfg), evals=evals, base=paths.absolute(cfg.base), stage="rl")

    trainer = StepLoop(model, stage.optimizer, plan=compute.plan, normalise=False)  # the weights carry the normalisation
    meter = Meter(cfg.steps)  # the ETA's rate: one step's time swings with its rollouts
    loop = stage.loop(cfg, cfg.steps, trainer, save, meter)
    loop.every(cfg.log_every, log_line)
    loop.every(cfg.eval_every, evaluate)
    loop.every(cfg.save_every, loop.save)
    t_loop = time.time()
    step = stage.step = loop.run(train_one)

    before, after = evals["0"], evals[str(step)]
    summary = dict(step=step, pass_at_1_before=before, pass_at_1_after=after, evals=evals,
                   train_seconds=time.time() - t_loop, run_dir=paths.absolute(cfg.run_dir))

    def report():
        png = plot_losses(metrics.read(), stage.folder.loss_plot, f"RL on {cfg.task} (loss = 1 - reward)",
                          val_key="pass_at_1", val_label="held-out pass@1")
        write_report(stage.folder.report, title="flaxchat RL", sections=[
            ("Result", {"pass@1 before (the base model)": f"{100 * before:.1f}%", "pass@1 after": f"{100 * after:.1f}%",
                        "held-out problems": min(cfg.eval_examples, len(val_task)),
                        "time": fmt_duration(time.time() - t_start)}),
            ("pass@1 by step", {k: f"{100 * v:.1f}%" for k, v in sorted(evals.items(), key=lambda kv: int(kv[0]))}),
            ("Reward curve", "![loss](loss.png)" if png else "(no steps logged)"),
            ("Config", dataclasses.asdict(cfg)),
        ])
        print0(f"done: pass@1 {100 * before:.1f}% -> {100 * after:.1f}% in {fmt_duration(time.time() - t_start)}")
        metrics.close()  # the trackers: process 0 only, as is this report

    return stage.finish(summary, report)


# --- rollouts as training rows ----------------------------------------------------------------------

def fit_prompt(prompt: list[int], T: int, room: int = 8) -> list[int]:
    """A prompt that leaves at least `room` tokens of the context to the answer: a long one keeps
    its start (<|bos|>, the question) and its last token (<|assistant_start|>), not its end alone."""
    if len(prompt) <= T - room:
        return prompt
    return prompt[:T - room - 1] + prompt[-1:]


def sample_answers(engine, prompt: list[int], n: int, max_tokens: int, **kwargs):
    """n sampled answers: (tokens, masks (1 sampled, 0 forced by the tool), the stop token each
    ended on or None when it ran out of budget). The stop token is not in the tokens."""
    outs, masks, stops = [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
    stop = set(engine.stop_tokens())
    done = [False] * n
    for column, forced in engine.generate(prompt, n, max_tokens, **kwargs):
        for r, tok in enumerate(column):
            if tok is None or done[r]:
                continue
            if not forced[r] and tok in stop:
                stops[r], done[r] = tok, True
                continue
            outs[r].append(tok)
            masks[r].append(0 if forced[r] else 1)
    return outs, masks, stops


def policy_rows(prompt, outs, masks, stops, end_id: int, T: int, pad: int):
    """(inputs, targets), each (samples, T) int32: prompt + answer (+ the end token only when the
    model sampled it), targets -1 except on the sampled answer tokens."""
    import numpy as np
    xs = np.full((len(outs), T + 1), pad, np.int32)
    train = np.zeros((len(outs), T + 1), bool)
    for r, (out, mask, stop) in enumerate(zip(outs, masks, stops)):
        if stop == end_id:
            out, mask = out + [end_id], mask + [1]
        row = prompt + out
        if len(row) > T + 1:
            raise ValueError(f"a rollout of {len(row)} tokens does not fit the context of {T}")
        xs[r, :len(row)] = row
        train[r, len(prompt):len(row)] = np.asarray(mask, bool)
    return xs[:, :-1], np.where(train[:, 1:], xs[:, 1:], -1).astype(np.int32)


def policy_weights(targets, advantages):
    """Per-token weights (problems, samples, T) of the policy loss sum(-w x log p): each problem's
    advantages spread over that problem's sampled tokens, and the problems averaged (chat_rl's
    per-pass normalisation): every problem weighs the same, whatever its answers' lengths."""
    import numpy as np
    valid = targets >= 0
    per_problem = np.maximum(valid.sum(axis=(1, 2), keepdims=True), 1)
    w = advantages[:, :, None] * valid / per_problem / targets.shape[0]
    return w.astype(np.float32)


def open_task(spec: str, split: str):
    import tasks
    name, path = tasks.split_spec(spec)
    task = tasks.get_task(name, split=split, **({"path": path} if path else {}))
    if task.eval_type != "generative":
        raise UserError(f"task {name!r} is multiple choice; RL needs a task with answers to sample and check "
                        "(arithmetic, spelling, gsm8k).")
    if len(task) == 0:
        raise UserError(f"task {spec!r} has no {split} examples.")
    return task


if __name__ == "__main__":
    sys.exit(cli_main(functools.partial(main, tune=True)))
