"""Pretrain a GPT: tokenizer -> model -> optimizer -> data -> loop, resuming exactly from a checkpoint.

    python -m scripts.pretrain --depth=4 --steps=1000 --run-dir=runs/d4
    python -m scripts.pretrain --depth=24                      # on a TPU pod, via the cloud launcher

A run folder that already holds a checkpoint resumes from it (same data position, same optimizer
state; the final weights equal an uninterrupted run's). `--fresh` starts over and moves the old
checkpoints aside (never deletes them). Several processes (a pod, or a rehearsal on one machine)
form one job when JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID are set.
"""

from __future__ import annotations

import functools
import dataclasses
import sys
import time

from flaxchat.config import TrainConfig, parse_config
from flaxchat.errors import UserError, cli_main
from flaxchat.kernels import tune_process

SAMPLE_PROMPTS = ["Once upon a time", "One day, a little", "The old dog"]


def parse_args(argv, defaults=None, description=__doc__, prog="python -m scripts.pretrain"):
    return parse_config(TrainConfig, argv, prog=prog, description=description, defaults=defaults)


def main(argv=None, defaults=None, tune=False) -> int:
    tc = parse_args(argv, defaults)
    if tune:  # after the flags, so that --help and a bad flag answer without JAX
        tune_process()
    run(tc)
    return 0


def check_model_config(tc: TrainConfig) -> None:
    """The model a run would build, validated before any work (the tokenizer trains later)."""
    from flaxchat.config import config_for_depth
    config_for_depth(tc.depth, vocab_size=tc.vocab_size, sequence_len=tc.sequence_len, window_pattern=tc.window_pattern)


def run(tc: TrainConfig) -> dict:
    """Run pretraining; the mesh it sets is undone when it returns (run_chat runs the stages in one process)."""
    from flaxchat.common import mesh_scope
    with mesh_scope():
        return _run(tc)


def _run(tc: TrainConfig) -> dict:
    # Heavy imports here so that --help and bad flags answer at once.
    import jax.numpy as jnp
    from flax import nnx

    from flaxchat import paths, sharding
    from flaxchat.common import (compute_init, fmt_duration, gather_streams, global_batch, local_streams,
                                 peak_rss_mb, print0)
    from flaxchat.config import config_for_depth
    from flaxchat.data.loader import LoaderGroup, PackingLoader, reshard_states
    from flaxchat.data.prefetch import Prefetcher
    from flaxchat.data.sources import resolve_source
    from flaxchat.evaluation import evaluate_bpb
    from flaxchat.gpt import (GPT, estimate_flops, matmul_param_count, param_count, reference_scaling_param_count,
                              scaling_param_count)
    from flaxchat.loop import Loop, Meter
    from flaxchat.optim import OptimConfig, Schedule, make_optimizer
    from flaxchat.profiling import StepProfiler
    from flaxchat.progress import Progress
    from flaxchat.rates import job_peak
    from flaxchat.recipe import batch_scaling_applies, estimated_passes, geometry, lr_rule_text, scaling
    from flaxchat.report import MetricsLog, plot_losses, write_json, write_report
    from flaxchat.stage import already_complete, barrier, complete_line, finish, open_run, place
    from flaxchat.tokenizer import fingerprint_beside, texts_of, train_or_load
    from flaxchat.trackers import open_trackers
    from flaxchat.train import StepLoop, sample

    t_start = time.time()
    check_model_config(tc)
    # A probe write now turns a missing gcsfs, missing credentials or a read-only bucket into one
    # sentence rather than a traceback at the first save. Every file goes through flaxchat.paths.
    paths.check_writable(tc.run_dir)
    run = paths.RunFolder(tc.run_dir)  # the layout of what this stage writes

    # --- compute ------------------------------------------------------------------------------
    compute = compute_init(tc.dtype, attention=tc.attention, grad_checkpoint=tc.grad_checkpoint,
                           scan_layers=tc.scan_layers)
    print0(f"compute: {compute.backend}, {compute.device_count} device(s) in {compute.process_count} process(es), "
           f"dtype {jnp.dtype(compute.compute_dtype).name}")

    # --- data sources and tokenizer -----------------------------------------------------------
    train_src = resolve_source(tc.data, split="train", seed=tc.seed, field=tc.text_field)
    val_src = resolve_source(tc.data, split="val", seed=tc.seed, field=tc.text_field)
    print0(f"data: {train_src.name}")
    tokenizer = load_tokenizer(tc, compute, run, lambda: texts_of(train_src), train_or_load, barrier)

    # --- model (its sizes from the abstract model: the real one is created once, on the mesh) --
    model_cfg = config_for_depth(tc.depth, vocab_size=tokenizer.vocab_size, sequence_len=tc.sequence_len,
                                 window_pattern=tc.window_pattern)
    new_model = lambda: GPT(model_cfg, rngs=nnx.Rngs(tc.seed), dtype=compute.compute_dtype, kernels=compute.kernels)
    abstract = nnx.eval_shape(new_model)
    n_params, n_scaling, flops_per_token = param_count(abstract), scaling_param_count(abstract), estimate_flops(abstract)
    print0(f"model: depth {model_cfg.n_layer}, width {model_cfg.n_embd}, {model_cfg.n_head} heads of "
           f"{model_cfg.head_dim}, windows {model_cfg.window_sizes()}, {n_params:,} parameters "
           f"({matmul_param_count(abstract):,} in matmuls), {flops_per_token / 1e6:.1f} MFLOP/token")

    # --- resume or start (the opener every stage shares: flaxchat.stage) -------------------------
    checkpointer, resume_step, meta = open_run(
        tc.run_dir, name="pretrain", fresh=tc.fresh, keep=tc.keep_checkpoints, compute=compute, model_cfg=model_cfg,
        tokenizer=tokenizer, log=print0, fix="use --fresh or another --run-dir (or the tokenizer it was trained with).")
    if tc.init_from and meta is None:
        tokenizer.check_matches(fingerprint_beside(tc.init_from), f"--init-from {tc.init_from}",
                                "train with the tokenizer saved beside it (--tokenizer-dir).")

    # --- batch geometry and horizon (nanochat's recipe: flaxchat.recipe) -------------------------
    T = tc.sequence_len
    rule = scaling(n_scaling, reference_scaling_param_count(model_cfg), tc.param_data_ratio, tc.weight_decay,
                   tc.total_batch_size)
    if tc.total_batch_size <= 0:
        print0(f"batch: nanochat's automatic size for {rule.target_tokens / 1e6:.1f}M tokens "
               f"({tc.param_data_ratio} x {n_scaling:,} scaling parameters): {rule.total_batch_size:,} tokens/step")
    geo = geometry(rule, device_batch_size=tc.device_batch_size, devices=compute.device_count, seq_len=T,
                   steps=tc.steps)
    steps, total = geo.steps, geo.total
    print0(geo.line())
    done = already_complete(tc.run_dir, resume_step, steps)
    if done is not None:  # a rerun of a finished run: its record stays as the run that trained wrote it
        checkpointer.close()
        print0(complete_line(tc.run_dir, resume_step))
        return dict(done, is_main=compute.is_main, already_complete=True)

    # --- optimizer ------------------------------------------------------------------------------
    schedule = Schedule(steps, tc.warmup_steps, tc.warmdown_ratio, tc.final_lr_frac)
    passes = estimated_passes(train_src, tokenizer, steps * total, T) if tc.lr_batch_scaling == "auto" else None
    scale_lrs = batch_scaling_applies(tc.lr_batch_scaling, tc.total_batch_size, passes)
    if passes is not None:
        print0(f"data: {steps * total / 1e6:.1f}M tokens read the training text about {passes:.1f} time(s)")
    ns_dtype = compute.polar.ns_dtype if tc.ns_dtype == "auto" else tc.ns_dtype
    opt_cfg = OptimConfig(optimizer=tc.optimizer, matrix_lr=tc.matrix_lr, embedding_lr=tc.embedding_lr,
                          unembedding_lr=tc.unembedding_lr, scalar_lr=tc.scalar_lr, weight_decay=rule.weight_decay,
                          adam_beta1=tc.adam_beta1, adam_beta2=tc.adam_beta2, n_embd=model_cfg.n_embd,
                          ns_dtype=ns_dtype, batch_lr_scale=rule.batch_lr_scale if scale_lrs else 1.0)
    print0(f"recipe: {lr_rule_text(tc.lr_batch_scaling, tc.total_batch_size, scale_lrs, total, rule.batch_lr_scale, passes)}; "
           f"Muon weight decay {rule.weight_decay:.4f}, Polar Express in {ns_dtype}; "
           f"{steps * total / n_scaling:.1f} tokens per scaling parameter")

    def make_model():
        model = new_model()
        if tc.init_from and meta is None:
            from flaxchat.export import load_params_into
            print0(f"initialised from {tc.init_from} (exported at step {load_params_into(model, tc.init_from)})")
        return model

    model, optimizer, compute, layout = place(compute, tc.sharding, make_model,
                                              lambda m: make_optimizer(m, opt_cfg, schedule, compute.polar), n_params)
    per_device = sharding.bytes_per_device(nnx.state(model, nnx.Param))
    print0(f"sharding: {layout} over {compute.device_count} device(s); parameters per device "
           f"{max(per_device.values()) / 2**20:.1f} MiB of {4 * n_params / 2**20:.1f} MiB")

    # --- data loaders: one stream per device, so the global batch does not depend on how the
    # devices are spread over processes (2 processes x 1 device == 1 process x 2 devices).
    streams = local_streams(compute)
    loaders = [PackingLoader(train_src, tokenizer, tc.device_batch_size, T, process_index=s,
                             process_count=compute.device_count) for s in streams]
    step = 0
    if meta is not None:
        step = checkpointer.restore(model, optimizer, resume_step)["step"]
        states = meta.get("loader_states") or []
        if states and len(states) != compute.device_count:
            print0(f"data: the checkpoint has {len(states)} data reader(s), this job {compute.device_count}; "
                   "resharding (no document skipped, about one row group per old reader seen twice)")
            states = reshard_states(states, compute.device_count, train_src)  # the same on every process
        for s, loader in zip(streams, loaders) if states else ():
            loader.load_state_dict(states[s])
        if not states:
            print0("warning: the checkpoint has no data loader states; the data order restarts.")
        print0(f"resumed from step {step} in {run.checkpoints}")
    batches = Prefetcher(LoaderGroup(loaders, geo.grad_accum), depth=2)  # packs the next batches meanwhile

    # --- what the loop does every N steps ------------------------------------------------------------
    config = dict(model=model_cfg.to_dict(), train=tc.to_dict(), steps=steps, total_batch_size=total,
                  grad_accum=geo.grad_accum, data=train_src.name)
    metrics = MetricsLog(run.metrics, trackers=open_trackers(  # --tracker: every line also goes to W&B/TensorBoard
        tc.tracker, tc.run_dir, stage="pretrain", run_name=tc.run_name, config=config, start_step=step,
        fresh=tc.fresh, is_main=compute.is_main))
    if compute.is_main:
        if step < steps and paths.exists(run.complete):
            paths.remove(run.complete)  # our own marker of an earlier, shorter run: this one is not done
        write_json(run.config, config)
    peak = job_peak(compute, print0)
    meter = Meter(steps, tokens_per_step=total, flops_per_token=flops_per_token, peak=peak)
    last_bpb = None

    def save(at):
        print0(f"step {at:05d} | saving checkpoint")
        states = gather_streams(dict(zip(streams, batches.state_dict())), compute.device_count)
        checkpointer.save(at, model, optimizer, dict(
            model_config=model_cfg.to_dict(), train_config=tc.to_dict(), loader_states=states, data=train_src.name,
            tokens_seen=at * total, optim_config=dataclasses.asdict(opt_cfg), tokenizer=tokenizer.fingerprint()))

    def log_line(at):
        lossf, r, lrm = meter.loss(at, loop.loss, "lower the learning rates or check the data."), meter.read(at), \
            float(schedule.lr_multiplier(at - 1))
        print0(f"step {at:05d}/{steps:05d} | loss {lossf:.4f} | lr x{lrm:.2f} | tok/s {r.tok_s:,.0f} | "
               f"mfu {r.mfu:.1f}% | eta {r.eta}")
        if compute.is_main:
            metrics.append(kind="train", step=at, loss=lossf, tok_per_s=r.tok_s, mfu=r.mfu, peak_flops=peak.flops,
                           lrm=lrm, time=time.time())

    def evaluate(at):
        nonlocal last_bpb
        last_bpb = evaluate_bpb(model, val_src, tokenizer, tc.eval_tokens, tc.device_batch_size)
        print0(f"step {at:05d} | val bpb {last_bpb:.4f}")
        if compute.is_main:
            metrics.append(kind="val", step=at, val_bpb=last_bpb)

    def stories(at):
        prompts = [tokenizer.encode(p, prepend=tokenizer.bos_token_id) for p in SAMPLE_PROMPTS[:tc.num_samples]]
        outs = sample(model, prompts, max_new=min(120, T - 8), seed=tc.seed + at)
        return [SAMPLE_PROMPTS[i] + tokenizer.decode(_until_bos(o, tokenizer.bos_token_id)) for i, o in enumerate(outs)]

    def sample_lines(at):
        if at == steps:
            return  # the end samples after the loop, once
        texts = stories(at)
        print0("\n".join(sample_text(s) for s in texts))
        metrics.note(kind="sample", step=at, samples=texts)

    # --- training loop ----------------------------------------------------------------------------
    trainer = StepLoop(model, optimizer, plan=compute.plan)
    progress = Progress("pretrain", steps=steps, process=compute.process_index, run_dir=tc.run_dir)
    progress.update(step, force=True)
    loop = Loop("pretrain", steps, start=step, trainer=trainer, save=save, checkpointer=checkpointer,
                progress=progress, meter=meter, log=print0, processes=compute.process_count, grace_s=tc.preempt_grace,
                profile=StepProfiler(tc.profile_steps, paths.join(tc.run_dir, "profile"), start_step=step, log=print0,
                                     is_main=compute.is_main, process=compute.process_index,
                                     processes=compute.process_count))
    loop.every(tc.log_every, log_line)
    loop.every(tc.eval_every, evaluate, last=tc.eval_every > 0)
    loop.every(tc.sample_every, sample_lines, last=False)
    loop.every(tc.save_every, loop.save)  # and the last step, always

    def train_one(at):
        x, y = batches.next_batch()  # (grad_accum, local rows, T) numpy
        try:
            loss = trainer(global_batch(compute, x), global_batch(compute, y))
            if at == loop.start:
                loss.block_until_ready()  # the first step allocates everything: out of memory shows here
        except Exception as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            raise out_of_memory(e, tc, model_cfg, n_params, compute) from None
        return loss

    step = loop.run(train_one)
    batches.close()
    smooth = meter.smooth
    if smooth is None or (last_bpb is None and tc.eval_every > 0):
        # A rerun of a finished run (killed after its last save, before COMPLETE) trains nothing:
        # its figures come from the metrics that run logged, the final val bpb measured if missing.
        smooth, last_bpb = finished_figures(metrics.read(), steps, smooth, last_bpb)
        if last_bpb is None and tc.eval_every > 0:
            evaluate(step)

    # --- samples, report, completion marker -------------------------------------------------------
    samples = stories(step)
    metrics.note(kind="sample", step=step, samples=samples)
    summary = dict(is_main=compute.is_main, step=step, steps=steps, final_loss=smooth, val_bpb=last_bpb,
                   compile_s=meter.compile_s, train_seconds=meter.trained_s, peak_rss_mb=peak_rss_mb(),
                   run_dir=paths.absolute(tc.run_dir))

    def report():  # process 0, before COMPLETE
        if samples:  # --num-samples=0: no stories, so no samples.txt and no Samples section
            print0("\n--- sampled stories ---")
            for s in samples:
                print0(s + "\n")
            paths.write_text(run.samples, "\n\n".join(samples) + "\n")
        png = plot_losses(metrics.read(), run.loss_plot, f"depth {tc.depth} on {train_src.name}")
        write_report(run.report, title=f"flaxchat pretraining: depth {tc.depth}", sections=[
            ("Run", {"data": train_src.name, "steps": steps, "tokens/step": total, "grad accumulation": geo.grad_accum,
                     "devices": f"{compute.device_count} {compute.backend} in {compute.process_count} process(es)",
                     "parameters": f"{n_params:,}", "final loss (smoothed)": f"{smooth:.4f}" if smooth else "-",
                     "val bpb": f"{last_bpb:.4f}" if last_bpb else "-", "compile": f"{meter.compile_s or 0:.1f}s",
                     "training time": fmt_duration(meter.trained_s), "peak RSS": f"{peak_rss_mb():.0f} MB"}),
            ("Loss curve", "![loss](loss.png)" if png else "(no steps logged)"),
            *([("Samples", [s.replace("\n", " ") for s in samples])] if samples else []),
            ("Config", model_cfg.to_dict()),
        ])

    finish(tc.run_dir, compute.is_main, checkpointer, progress, step, summary, report)
    metrics.close()
    bpb = f"val bpb {last_bpb:.4f}" if last_bpb is not None else "no validation (--eval-every=0)"
    print0(f"done: {step} steps in {fmt_duration(time.time() - t_start)}; {bpb}; report {run.report}")
    summary["samples"] = samples
    return summary


def load_tokenizer(tc: TrainConfig, compute, run, texts, train_or_load, barrier):
    """Process 0 trains (or loads) the tokenizer, the others load what it saved. The tokenizer
    speaks to local files only: a gs:// folder is mirrored through a local copy."""
    from flaxchat import paths
    from flaxchat.common import print0
    tok_dir = tc.tokenizer_dir or run.tokenizer
    tokenizer = None
    if compute.is_main:
        with paths.local_copy(tok_dir) as local:
            tokenizer = train_or_load(local, texts, tc.vocab_size, max_chars=tc.max_chars_tokenizer, log=print0)
    barrier("tokenizer")
    if not compute.is_main:
        with paths.local_copy(tok_dir, upload=False) as local:
            tokenizer = train_or_load(local, texts, tc.vocab_size, max_chars=tc.max_chars_tokenizer, log=None)
    return tokenizer


def sample_text(story: str) -> str:
    """A mid-run `sample:` line: the text as it reads, later lines indented under the first."""
    return "sample: " + story.strip().replace("\n", "\n        ")


def out_of_memory(e: Exception, tc: TrainConfig, model_cfg, n_params: int, compute) -> UserError:
    """The one sentence for an XLA RESOURCE_EXHAUSTED in the train step: the sizes and what to change."""
    import re
    from flaxchat.sharding import device_memory_bytes
    asked = re.search(r"(\d{7,}) bytes", str(e))
    limit = device_memory_bytes()
    failed = f"an allocation of {int(asked.group(1)) / 2**30:.1f} GiB failed" if asked else "an allocation failed"
    has = f" on devices of {limit / 2**30:.1f} GiB" if limit else ""
    return UserError(
        f"out of memory in the train step ({failed}{has}) at --device-batch-size {tc.device_batch_size} x "
        f"--sequence-len {tc.sequence_len} on depth {model_cfg.n_layer} ({n_params:,} parameters, "
        f"{compute.device_count} device(s)); lower --device-batch-size (gradient accumulation keeps "
        f"--total-batch-size){'' if tc.grad_checkpoint else ' or add --grad-checkpoint'}, and check a configuration "
        "first with `python -m bench.scale --topology ...`. Nothing was saved.")


def finished_figures(entries: list[dict], steps: int, smooth: float | None, last_bpb: float | None):
    """(smoothed loss, final val bpb) of a run from its metrics log, where the loop did not compute
    them: the loss smoothed as the loop smooths it, the bpb only if measured at the last step."""
    if smooth is None:
        for e in entries:
            if e.get("kind") == "train" and e.get("loss") is not None:
                smooth = e["loss"] if smooth is None else 0.9 * smooth + 0.1 * e["loss"]
    if last_bpb is None:
        last_bpb = next((e["val_bpb"] for e in entries if e.get("kind") == "val" and e.get("step") == steps), None)
    return smooth, last_bpb


def _until_bos(tokens, bos):
    return tokens[:tokens.index(bos)] if bos in tokens else tokens


if __name__ == "__main__":
    sys.exit(cli_main(functools.partial(main, tune=True)))
