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
import math
import sys
import time

from flaxchat.config import TrainConfig, parse_config
from flaxchat.errors import UserError, cli_main
from flaxchat.kernels import tune_process

HELP = {
    "run_dir": "folder for checkpoints, report, plot and samples",
    "data": "'stories' (built-in, offline), a path/glob of .txt/.jsonl/.parquet, or hf:owner/dataset",
    "depth": "the one dial: layers; width = 64 x depth",
    "steps": "optimizer steps; -1 derives them from --param-data-ratio",
    "device_batch_size": "rows per micro-batch per device",
    "total_batch_size": "tokens per optimizer step (gradient accumulation fills it); -1: nanochat's automatic "
                        "size, 2^19 x (D/D_ref)^0.383 rounded to a power of two (D: this run's horizon, D_ref: d12's)",
    "param_data_ratio": "training tokens per scaling parameter (block matrices + LM head) when --steps is -1",
    "matrix_lr": "Muon LR at 2^19 tokens/step; every LR is scaled by sqrt(B/2^19) (nanochat; see --lr-batch-scaling)",
    "embedding_lr": "token-embedding AdamW LR at d_model 768 and 2^19 tokens/step (scaled by width and batch)",
    "unembedding_lr": "LM-head AdamW LR at d_model 768 and 2^19 tokens/step (scaled by width and batch)",
    "scalar_lr": "per-layer scalar AdamW LR at 2^19 tokens/step (scaled by batch)",
    "weight_decay": "Muon's cautious weight decay at d12 and 2^19 tokens/step; scaled by sqrt(B/B_ref) x D_ref/D, "
                    "cosine to 0",
    "lr_batch_scaling": "scale every LR by sqrt(total batch / 2^19) as nanochat does: on, off, or auto (on with the "
                        "automatic --total-batch-size -1, and with a batch you give when the run reads its training "
                        "text 2 times or more, where the LRs as given memorise it; off below that, where the "
                        "rule's 16-22x smaller LRs at 1-2K-token steps made val bpb worse; docs/recipe.md)",
    "warmup_steps": "LR warmup steps",
    "warmdown_ratio": "fraction of the steps over which the LR falls linearly to --final-lr-frac",
    "attention": "attention kernel: auto (splash on TPU, cudnn on GPU, blockwise on CPU), blockwise, xla, splash, cudnn",
    "init_from": "start from these weights (model.pkl, weights.npz or a run folder); ignored when resuming",
    "fresh": "start at step 0 even if the run folder has a checkpoint (the old one is moved aside, not deleted)",
    "sequence_len": "tokens per row (the context the model trains on)",
    "vocab_size": "tokenizer vocabulary, trained on --data when --tokenizer-dir has none",
    "window_pattern": "attention windows tiled over the layers: S = a quarter of the context, L = all of it "
                      "(the last layer is always L)",
    "optimizer": "muon (Muon for the block matrices + AdamW groups, nanochat's) or adamw (AdamW everywhere)",
    "adam_beta1": "AdamW beta1 of the embedding, LM-head and scalar groups",
    "adam_beta2": "AdamW beta2 of the scalar groups",
    "final_lr_frac": "LR at the end of the warmdown, as a fraction of the peak",
    "dtype": "compute dtype: auto (bf16 on TPU/GPU, fp32 on CPU), float32, bfloat16",
    "ns_dtype": "Muon's orthogonalisation (Polar Express): auto (bf16 on TPU/GPU; on a CPU with bf16 dot "
                "instructions bf16-operands on AMD and bf16-products on Intel, fp32 elsewhere), float32, bfloat16, "
                "bf16-products (fp32, with two of its three products from bf16 operands; rectangular matrices in "
                "the fp32 Gram form) or bf16-operands (as bf16-products, with every product that reads the iterate "
                "from bf16 operands); see docs/cpu.md",
    "sharding": "dp (parameters replicated), fsdp (parameters, gradients and optimizer state split), auto",
    "eval_every": "steps between validation bpb evaluations, and one at the end (0: none)",
    "eval_tokens": "validation tokens per evaluation",
    "sample_every": "steps between sampled stories (0: none during training; the end always samples)",
    "save_every": "steps between checkpoints (0: only the last step, which is always saved)",
    "keep_checkpoints": "how many checkpoints to keep",
    "preempt_grace": "seconds from SIGTERM (a preemption notice) to exit: the step in flight finishes and is "
                     "saved, exit code 75; a save still going then is given up (docs/deployment.md)",
    "log_every": "steps between progress lines",
    "seed": "seed of the initialisation and the data order",
    "grad_checkpoint": "recompute each block's activations in the backward (less memory, more compute)",
    "scan_layers": "run the layers that repeat (4 per period with SSSL) under one lax.scan, so the compiler "
                   "compiles those blocks once, not once per layer (docs/accelerators.md); same parameters and "
                   "checkpoints",
    "text_field": "the .jsonl field or parquet column that holds the text (a hub --data sets it with ?field=)",
    "tokenizer_dir": "a trained tokenizer to use (default: <run-dir>/tokenizer, trained on --data if absent)",
    "max_chars_tokenizer": "characters of --data the tokenizer is trained on",
    "num_samples": "stories sampled at each --sample-every and at the end",
    "tracker": "where the metrics also go: wandb, tensorboard, none, or a comma list (flaxchat.trackers)",
    "run_name": "the trackers' name of the run (default: the run folder's name)",
    "profile_steps": "A:B: a jax.profiler trace of steps A..B-1 into <run>/profile",
}
SAMPLE_PROMPTS = ["Once upon a time", "One day, a little", "The old dog"]


def parse_args(argv, defaults=None, description=__doc__, prog="python -m scripts.pretrain"):
    return parse_config(TrainConfig, argv, prog=prog, description=description, defaults=defaults, help=HELP)


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
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from flaxchat import paths, sharding
    from flaxchat.common import (compute_init, device_peak_flops, fmt_duration, gather_streams, global_batch,
                                 local_streams, matmul_flops, peak_rss_mb, print0, spec_peak_flops)
    from flaxchat.config import GPTConfig, config_for_depth
    from flaxchat.data.loader import LoaderGroup, PackingLoader, reshard_states
    from flaxchat.data.prefetch import Prefetcher
    from flaxchat.data.sources import resolve_source
    from flaxchat.gpt import (GPT, estimate_flops, matmul_param_count, param_count, reference_scaling_param_count,
                              scaling_param_count)
    from flaxchat.optim import OptimConfig, Schedule, make_optimizer, scaling
    from flaxchat.progress import Progress
    from flaxchat.rates import Peak, StepRate
    from flaxchat.stage import StopOnSignal, already_complete, barrier, complete_line, finish, open_checkpoints
    from flaxchat.profiling import StepProfiler
    from flaxchat.report import MetricsLog, plot_losses, write_json, write_report
    from flaxchat.trackers import open_trackers
    from flaxchat.tokenizer import fingerprint_beside, texts_of, train_or_load
    from flaxchat.train import StepLoop, bits_per_byte, eval_step, sample

    t_start = time.time()
    check_model_config(tc)
    # --- run folder: local or gs://. Every file in it goes through flaxchat.paths (checkpoints
    # through Orbax); a probe write here turns a missing gcsfs, missing credentials or a read-only
    # bucket into one sentence now rather than a traceback at the first save.
    paths.check_writable(tc.run_dir)

    # --- compute ------------------------------------------------------------------------------
    compute = compute_init(tc.dtype, attention=tc.attention, grad_checkpoint=tc.grad_checkpoint,
                           scan_layers=tc.scan_layers)
    print0(f"compute: {compute.backend}, {compute.device_count} device(s) in {compute.process_count} process(es), "
           f"dtype {jnp.dtype(compute.compute_dtype).name}")

    # --- data sources and tokenizer -----------------------------------------------------------
    train_src = resolve_source(tc.data, split="train", seed=tc.seed, field=tc.text_field)
    val_src = resolve_source(tc.data, split="val", seed=tc.seed, field=tc.text_field)
    print0(f"data: {train_src.name}")
    run = paths.RunFolder(tc.run_dir)  # the layout of what this stage writes
    tok_dir = tc.tokenizer_dir or run.tokenizer
    # Process 0 trains (or loads) the tokenizer; the others load what it saved. The tokenizer
    # speaks to local files only: a gs:// folder is mirrored through a local copy.
    if compute.is_main:
        with paths.local_copy(tok_dir) as local_tok:
            tokenizer = train_or_load(local_tok, lambda: texts_of(train_src), tc.vocab_size,
                                      max_chars=tc.max_chars_tokenizer, log=print0)
    barrier("tokenizer")
    if not compute.is_main:
        with paths.local_copy(tok_dir, upload=False) as local_tok:
            tokenizer = train_or_load(local_tok, lambda: texts_of(train_src), tc.vocab_size,
                                      max_chars=tc.max_chars_tokenizer, log=None)
    token_bytes = jnp.asarray(tokenizer.token_bytes())

    # --- checkpoint: resume or start (the skeleton every stage shares: flaxchat.stage) -----------
    ckpt_dir = run.checkpoints
    checkpointer, resume_step, meta = open_checkpoints(tc.run_dir, fresh=tc.fresh, keep=tc.keep_checkpoints,
                                                       is_main=compute.is_main, log=print0, name="pretrain")

    # --- model ---------------------------------------------------------------------------------
    model_cfg = config_for_depth(tc.depth, vocab_size=tokenizer.vocab_size, sequence_len=tc.sequence_len,
                                 window_pattern=tc.window_pattern)
    if meta is not None:
        saved = GPTConfig.from_dict(meta["model_config"])
        if saved != model_cfg:
            raise UserError(f"{tc.run_dir} holds a checkpoint of a different model (depth {saved.n_layer}, "
                            f"width {saved.n_embd}, seq {saved.sequence_len}); use --fresh or another --run-dir.")
        tokenizer.check_matches(meta.get("tokenizer"), f"the checkpoint in {tc.run_dir}",
                                "resume with the tokenizer it was trained with, or use --fresh or another --run-dir.")
    if tc.init_from and meta is None:
        tokenizer.check_matches(fingerprint_beside(tc.init_from), f"--init-from {tc.init_from}",
                                "train with the tokenizer saved beside it (--tokenizer-dir).")
    def make_model():
        model = GPT(model_cfg, rngs=nnx.Rngs(tc.seed), dtype=compute.compute_dtype, kernels=compute.kernels)
        if tc.init_from and meta is None:
            from flaxchat.export import load_params_into
            at = load_params_into(model, tc.init_from)
            print0(f"initialised from {tc.init_from} (exported at step {at})")
        return model

    # Sizes come from the abstract model (shapes only): the real one is created once, on the mesh.
    abstract = nnx.eval_shape(lambda: GPT(model_cfg, rngs=nnx.Rngs(tc.seed), dtype=compute.compute_dtype,
                                          kernels=compute.kernels))
    n_params, n_matmul, n_scaling = param_count(abstract), matmul_param_count(abstract), scaling_param_count(abstract)
    n_scaling_ref = reference_scaling_param_count(model_cfg)  # d12 at this vocabulary and context
    flops_per_token = estimate_flops(abstract)
    print0(f"model: depth {model_cfg.n_layer}, width {model_cfg.n_embd}, {model_cfg.n_head} heads of "
           f"{model_cfg.head_dim}, windows {model_cfg.window_sizes()}, {n_params:,} parameters "
           f"({n_matmul:,} in matmuls), {flops_per_token / 1e6:.1f} MFLOP/token")

    # --- batch geometry and horizon -------------------------------------------------------------
    T = tc.sequence_len
    rows_per_micro = tc.device_batch_size * compute.device_count
    rule = scaling(n_scaling, n_scaling_ref, tc.param_data_ratio, tc.weight_decay, tc.total_batch_size)
    total = rule.total_batch_size
    if tc.total_batch_size <= 0:
        print0(f"batch: nanochat's automatic size for {rule.target_tokens / 1e6:.1f}M tokens "
               f"({tc.param_data_ratio} x {n_scaling:,} scaling parameters): {total:,} tokens/step")
    if total < rows_per_micro * T:
        raise UserError(f"--total-batch-size {total} is smaller than one micro-batch (device_batch_size x devices x "
                        f"sequence_len = {rows_per_micro * T}); lower --device-batch-size or raise --total-batch-size.")
    if total % (rows_per_micro * T):
        raise UserError(f"--total-batch-size {total} is not a multiple of device_batch_size x devices x "
                        f"sequence_len = {rows_per_micro * T}.")
    grad_accum = total // (rows_per_micro * T)
    if tc.steps > 0:
        steps = tc.steps
    else:
        steps = max(1, int(rule.target_tokens // total))
    print0(batch_line(total, grad_accum, rows_per_micro, T, steps))
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
    ns_dtype = compute.kernels.ns_dtype if tc.ns_dtype == "auto" else tc.ns_dtype
    opt_cfg = OptimConfig(optimizer=tc.optimizer, matrix_lr=tc.matrix_lr, embedding_lr=tc.embedding_lr,
                          unembedding_lr=tc.unembedding_lr, scalar_lr=tc.scalar_lr, weight_decay=rule.weight_decay,
                          adam_beta1=tc.adam_beta1, adam_beta2=tc.adam_beta2, n_embd=model_cfg.n_embd,
                          ns_dtype=ns_dtype, batch_lr_scale=rule.batch_lr_scale if scale_lrs else 1.0)
    lr_rule = lr_rule_text(tc.lr_batch_scaling, tc.total_batch_size, scale_lrs, total, rule.batch_lr_scale, passes)
    print0(f"recipe: {lr_rule}; "
           f"Muon weight decay {rule.weight_decay:.4f}, Polar Express in {ns_dtype}; "
           f"{steps * total / n_scaling:.1f} tokens per scaling parameter")
    layout = sharding.choose(tc.sharding, 4 * n_params, 2.0, sharding.device_memory_bytes())
    compute = compute.with_sharding(layout)
    jax.set_mesh(compute.mesh)  # logical activation constraints inside the model resolve on this mesh
    # Always place the state, even on one device: arrays left uncommitted would come back from the
    # first step committed to the mesh, and the changed input types would compile the step twice.
    model, optimizer = sharding.create_sharded(
        make_model, lambda m: make_optimizer(m, opt_cfg, schedule, compute.kernels), compute.mesh)
    per_device = sharding.bytes_per_device(nnx.state(model, nnx.Param))
    print0(f"sharding: {layout} over {compute.device_count} device(s); parameters per device "
           f"{max(per_device.values()) / 2**20:.1f} MiB of {4 * n_params / 2**20:.1f} MiB")

    # --- data loaders: one stream per device, so the global batch does not depend on how the
    # devices are spread over processes (2 processes x 1 device == 1 process x 2 devices).
    local_shards = local_streams(compute)
    loaders = [PackingLoader(train_src, tokenizer, tc.device_batch_size, T, process_index=s,
                             process_count=compute.device_count) for s in local_shards]
    step = 0
    if meta is not None:
        step = checkpointer.restore(model, optimizer, resume_step)["step"]
        states = meta.get("loader_states") or []
        if states and len(states) != compute.device_count:
            print0(f"data: the checkpoint has {len(states)} data reader(s), this job {compute.device_count}; "
                   "resharding (no document skipped, about one row group per old reader seen twice)")
            states = reshard_states(states, compute.device_count, train_src)  # the same on every process
        if states:
            for s, loader in zip(local_shards, loaders):
                loader.load_state_dict(states[s])
        else:
            print0("warning: the checkpoint has no data loader states; the data order restarts.")
        print0(f"resumed from step {step} in {ckpt_dir}")
    # A background thread packs the next batches while the device trains on this one.
    batches = Prefetcher(LoaderGroup(loaders, grad_accum), depth=2)

    def next_batch():
        x, y = batches.next_batch()  # (grad_accum, local rows, T) numpy
        return global_batch(compute, x), global_batch(compute, y)

    def loader_meta():
        return gather_streams(dict(zip(local_shards, batches.state_dict())), compute.device_count)

    def save(at_step):
        print0(f"step {at_step:05d} | saving checkpoint")
        step_fn.sync()
        checkpointer.save(at_step, model, optimizer, dict(
            model_config=model_cfg.to_dict(), train_config=tc.to_dict(), loader_states=loader_meta(),
            data=train_src.name, tokens_seen=at_step * total, optim_config=dataclasses.asdict(opt_cfg),
            tokenizer=tokenizer.fingerprint()))

    def evaluate():
        step_fn.sync()
        loader = PackingLoader(val_src, tokenizer, tc.device_batch_size, T, process_index=0, process_count=1)
        nats = nbytes = 0.0
        for _ in range(max(1, tc.eval_tokens // (tc.device_batch_size * T))):
            x, y = loader.next_batch()
            a, b, _ = eval_step(model, jnp.asarray(x), jnp.asarray(y), token_bytes)
            nats, nbytes = nats + float(a), nbytes + float(b)
        return bits_per_byte(nats, nbytes)

    def stories():
        step_fn.sync()
        prompts = [tokenizer.encode(p, prepend=tokenizer.bos_token_id) for p in SAMPLE_PROMPTS[:tc.num_samples]]
        outs = sample(model, prompts, max_new=min(120, T - 8), seed=tc.seed + step)
        return [SAMPLE_PROMPTS[i] + tokenizer.decode(_until_bos(o, tokenizer.bos_token_id)) for i, o in enumerate(outs)]

    config = dict(model=model_cfg.to_dict(), train=tc.to_dict(), steps=steps, total_batch_size=total,
                  grad_accum=grad_accum, data=train_src.name)
    metrics = MetricsLog(run.metrics, trackers=open_trackers(  # --tracker: every line also goes to W&B/TensorBoard
        tc.tracker, tc.run_dir, stage="pretrain", run_name=tc.run_name, config=config, start_step=step,
        fresh=tc.fresh, is_main=compute.is_main))
    complete_marker = run.complete
    if compute.is_main and step < steps and paths.exists(complete_marker):
        paths.remove(complete_marker)  # our own marker of an earlier, shorter run: this one is not done
    if compute.is_main:
        write_json(run.config, config)

    # --- training loop ----------------------------------------------------------------------------
    progress = Progress("pretrain", steps=steps, process=compute.process_index, run_dir=tc.run_dir)
    progress.update(step, force=True)
    # MFU against a peak that cannot be exceeded (the spec sheet's, or the best of this run's
    # measured ones); the ETA from a smoothed step rate, evaluations and saves included.
    spec = spec_peak_flops()
    peak = Peak(spec=spec * compute.device_count if spec else None,
                probe=lambda: device_peak_flops(compute, measure=True) * compute.device_count, log=print0)
    if spec:  # both peaks, so an MFU can be read against either
        measured = matmul_flops(8192, jnp.bfloat16)
        print0(f"mfu: counted against the spec sheet's {spec / 1e12:.0f} TFLOP/s per device; a bf16 8192³ matmul "
               f"measures {measured / 1e12:.1f} here ({100 * measured / spec:.0f}% of it)")
    else:
        print0(f"mfu: counted against a {jnp.dtype(compute.compute_dtype).name} matmul timed here, "
               f"{peak.flops / compute.device_count / 1e9:,.0f} GFLOP/s per device (no spec sheet for this device)")
    rate = StepRate()
    smooth, t_window, tokens_window, t_loop, compile_s = None, time.time(), 0, time.time(), None
    t_rate, step_rate_from, tps = None, step, None
    last_bpb = None
    step_fn = StepLoop(model, optimizer)  # model and optimizer hold its arrays after step_fn.sync()
    profiler = StepProfiler(tc.profile_steps, paths.join(tc.run_dir, "profile"), start_step=step, log=print0,
                            is_main=compute.is_main, process=compute.process_index, processes=compute.process_count)
    # SIGTERM (a preemption's notice) or Ctrl-C: this step is saved, then the run stops
    with StopOnSignal(print0, processes=compute.process_count, grace_s=tc.preempt_grace) as notice:
        while step < steps:
            notice.stop_here(step, checkpointer, save)
            x, y = next_batch()
            t0 = time.time()
            try:
                loss = step_fn(x, y)
                if compile_s is None:
                    loss.block_until_ready()  # the first step allocates everything: out of memory shows here
            except Exception as e:
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                raise out_of_memory(e, tc, model_cfg, n_params, compute) from None
            step += 1
            profiler.at(step, loss)
            if progress.due():
                loss.block_until_ready()  # progress means a finished step, not a dispatched one
                progress.update(step, loss=float(loss), tok_s=tps)
            if compile_s is None:
                compile_s = time.time() - t0
                t_window, tokens_window, t_loop = time.time(), 0, time.time()
                t_rate, step_rate_from = time.time(), step
                print0(f"compiled the train step in {compile_s:.1f}s")
            else:
                tokens_window += total
            if step % tc.log_every == 0 or step == steps:
                lossf = float(loss)
                if not math.isfinite(lossf):
                    raise UserError(f"the loss became {lossf} at step {step}; lower the learning rates or check the data.")
                smooth = lossf if smooth is None else 0.9 * smooth + 0.1 * lossf
                dt = max(time.time() - t_window, 1e-9)
                tps = tokens_window / dt if tokens_window else 0.0
                mfu = peak.mfu(tps * flops_per_token)
                if t_rate is not None:  # wall time since the last line, evaluations and saves included
                    rate.update(step - step_rate_from, time.time() - t_rate)
                    t_rate, step_rate_from = time.time(), step
                print0(f"step {step:05d}/{steps:05d} | loss {lossf:.4f} | lr x{float(schedule.lr_multiplier(step - 1)):.2f} | "
                       f"tok/s {tps:,.0f} | mfu {mfu:.1f}% | eta {rate.eta_text(steps - step)}")
                if compute.is_main:
                    metrics.append(kind="train", step=step, loss=lossf, tok_per_s=tps, mfu=mfu, peak_flops=peak.flops,
                                   lrm=float(schedule.lr_multiplier(step - 1)), time=time.time())
                t_window, tokens_window = time.time(), 0
            if tc.eval_every > 0 and (step % tc.eval_every == 0 or step == steps):
                last_bpb = evaluate()
                print0(f"step {step:05d} | val bpb {last_bpb:.4f}")
                if compute.is_main:
                    metrics.append(kind="val", step=step, val_bpb=last_bpb)
            if tc.sample_every > 0 and step % tc.sample_every == 0 and step < steps:
                texts = stories()
                print0("\n".join(sample_text(s) for s in texts))
                metrics.note(kind="sample", step=step, samples=texts)
            if step == steps or (tc.save_every > 0 and step % tc.save_every == 0):
                save(step)
            if tokens_window == 0:
                t_window = time.time()  # evaluation, sampling and saving are not training time
    batches.close()
    profiler.close()
    step_fn.sync()
    train_seconds = time.time() - t_loop
    if smooth is None or (last_bpb is None and tc.eval_every > 0):
        # A rerun of a finished run (killed after its last save, before COMPLETE) trains nothing:
        # its figures come from the metrics that run logged, the final val bpb measured if missing.
        smooth, last_bpb = finished_figures(metrics.read(), steps, smooth, last_bpb)
        if last_bpb is None and tc.eval_every > 0:
            last_bpb = evaluate()
            print0(f"step {step:05d} | val bpb {last_bpb:.4f}")
            if compute.is_main:
                metrics.append(kind="val", step=step, val_bpb=last_bpb)

    # --- samples, report, completion marker -------------------------------------------------------
    samples = stories()
    metrics.note(kind="sample", step=step, samples=samples)
    summary = dict(is_main=compute.is_main, step=step, steps=steps, final_loss=smooth, val_bpb=last_bpb, compile_s=compile_s,
                   train_seconds=train_seconds, peak_rss_mb=peak_rss_mb(), run_dir=paths.absolute(tc.run_dir))

    def report():  # process 0, before COMPLETE
        if samples:  # --num-samples=0: no stories, so no samples.txt and no Samples section
            print0("\n--- sampled stories ---")
            for s in samples:
                print0(s + "\n")
            paths.write_text(run.samples, "\n\n".join(samples) + "\n")
        entries = metrics.read()
        png = plot_losses(entries, run.loss_plot, f"depth {tc.depth} on {train_src.name}")
        write_report(run.report, title=f"flaxchat pretraining: depth {tc.depth}", sections=[
            ("Run", {"data": train_src.name, "steps": steps, "tokens/step": total, "grad accumulation": grad_accum,
                     "devices": f"{compute.device_count} {compute.backend} in {compute.process_count} process(es)",
                     "parameters": f"{n_params:,}", "final loss (smoothed)": f"{smooth:.4f}" if smooth else "-",
                     "val bpb": f"{last_bpb:.4f}" if last_bpb else "-", "compile": f"{compile_s or 0:.1f}s",
                     "training time": fmt_duration(train_seconds), "peak RSS": f"{peak_rss_mb():.0f} MB"}),
            ("Loss curve", "![loss](loss.png)" if png else "(no steps logged)"),
            *([("Samples", [s.replace("\n", " ") for s in samples])] if samples else []),
            ("Config", model_cfg.to_dict()),
        ])

    finish(tc.run_dir, compute.is_main, checkpointer, progress, step, summary, report)
    metrics.close()
    bpb = f"val bpb {last_bpb:.4f}" if last_bpb is not None else "no validation (--eval-every=0)"
    print0(f"done: {step} steps in {fmt_duration(time.time() - t_start)}; {bpb}; "
           f"report {run.report}")
    summary["samples"] = samples
    return summary


def batch_line(total: int, grad_accum: int, rows: int, seq_len: int, steps: int) -> str:
    """The `batch:` line every run prints (the README's main-job figures are read against it)."""
    return (f"batch: {total:,} tokens/step = {grad_accum} micro-batch(es) of {rows} x {seq_len}; "
            f"{steps:,} steps = {steps * total / 1e6:.1f}M tokens")


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


def sample_text(story: str) -> str:
    """A mid-run `sample:` line: the text as it reads, later lines indented under the first."""
    return "sample: " + story.strip().replace("\n", "\n        ")


# nanochat's sqrt(B/2^19) LR rule with a batch you give applies once a run reads its training text
# this many times or more. Measured with bench.quality at 2,048 tokens per step (docs/recipe.md): on
# a text read 4.9 times the LRs as given memorised it (val bpb 2.28 -> 2.79 from step 200 to 600,
# nanochat 2.15) and the rule ended at 2.13-2.14 (two seeds); on one read 1.3 times the LRs as given ended 0.12 below
# the rule; on Vim's help files (~0.3 passes) and the built-in stories, 0.2 and 0.1 below.
REPEAT_PASSES = 2.0


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
