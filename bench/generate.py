"""Generation speed of the Engine, printed (never asserted): compile time, time to first token,
batch-1 decode tok/s, batch-8 throughput, recompiles, the roofline bound, speculative decoding.

    python -m bench.generate                                   # config A (depth 4), random weights
    python -m bench.generate --depth 12 --vocab 32768 --seq 2048    # a d12 model (on a GPU or TPU)
    python -m bench.generate --main-run runs/a --draft-run runs/b   # + speculative decoding

Config A: 4 layers, n_embd 256, 4 heads, vocab 4096, context 256; a 16-token prompt and 128 new
tokens. `--depth` takes the depth preset instead. Decode is memory-bound: tok/s <= bytes/s / bytes
read per token (every matmul weight as stored, and the KV cache). The bound is measured on this
machine at the moment of the run. On a CPU (a shared 2-core box: the load average is printed with
every figure): a jitted 2048^3 matmul for the FLOP/s peak; the bytes/s of the best matrix-vector
product here (OpenBLAS on both cores) over the model's size (L3-resident) and over 256 MB (main
memory); and the model's own matrices as a chain of XLA matrix-vector products. On an accelerator:
its bf16 matmul peak and its copy bandwidth (a jitted copy of 1 GiB, bytes read and written).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat import engine as E
from flaxchat.common import measured_matmul_peak, resolve_dtype
from flaxchat.config import GPTConfig, config_for_depth
from flaxchat.errors import UserError
from flaxchat.gpt import GPT, matmul_param_count

CONFIG_A = GPTConfig(n_layer=4, n_embd=256, n_head=4, n_kv_head=4, vocab_size=4096, sequence_len=256)


def load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def random_model(cfg: GPTConfig, seed: int = 0, dtype=jnp.float32) -> GPT:
    """Config-shaped model with random numpy weights (speed does not depend on the values); fp32
    parameters as training keeps them, computing in `dtype`."""
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda l: jnp.asarray(rng.standard_normal(l.shape) * 0.05, jnp.float32), state))
    return model


def model_matrices(model: GPT):
    """The kernels a decode step multiplies by, in layer order (lm_head last)."""
    mats = [leaf[...] for path, leaf in nnx.to_flat_state(nnx.state(model, nnx.Param))
            if path[-1] == "kernel" and "gate" not in ".".join(map(str, path))]
    return mats[:-1], mats[-1]


def bandwidth(nbytes: int, d: int, reps: int = 7) -> float:
    """Bytes/s of the best matrix-vector product on this machine (numpy's OpenBLAS, both cores) over
    `nbytes` of fp32 weights cut into (d, 4096) blocks, every output element used. At the model's
    size (~17 MB) the blocks stay in the 32 MB L3 cache; far past it (256 MB) this is main memory."""
    rng = np.random.default_rng(0)
    blocks = [rng.standard_normal((d, 4096), dtype=np.float32) for _ in range(max(1, nbytes // (d * 4096 * 4)))]
    x = np.ones(d, np.float32)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for w in blocks:
            x = x + 1e-9 * (x @ w).reshape(-1, d).sum(0)  # each product needs the one before
        best = min(best, time.perf_counter() - t)
    return sum(w.nbytes for w in blocks) / best


def matvec_floor(model: GPT, steps: int = 128) -> float:
    """Steps/s of a decode-shaped chain doing only the model's matrix-vector products, one after
    the other (the same matrices, batch 1, a residual add and a nonlinearity between them): what any
    implementation made of XLA operations reaches here before attention, norms and sampling. Every
    output of the head is used (a sliced product lets XLA read only the columns kept)."""
    blocks, head = model_matrices(model)
    d = blocks[0].shape[0]

    @jax.jit
    def loop(blocks, head, x):
        def body(_, x):
            for i in range(0, len(blocks), 6):  # attn c_k, c_proj, c_q, c_v; mlp c_fc, c_proj
                ck, cp, cq, cv, fc, fp = blocks[i:i + 6]
                q, k, v = x @ cq, x @ ck, x @ cv
                x = x + jnp.tanh(q + jnp.tile(k + v, q.shape[-1] // k.shape[-1])) @ cp
                x = x + jax.nn.relu(x @ fc) @ fp
            return x + 1e-3 * jnp.tanh(x @ head).reshape(1, -1, d).sum(1)
        return jax.lax.fori_loop(0, steps, body, x)

    x = jnp.ones((1, d), jnp.float32)
    loop(blocks, head, x).block_until_ready()
    return steps / min(_timed(lambda: loop(blocks, head, x).block_until_ready()) for _ in range(5))


def step_kernels() -> int | None:
    """Kernels (fusions, dots, copies, ...) XLA:CPU runs per step of the compiled decode loop; None
    where the module is not XLA:CPU's kind of text (a TPU's or GPU's fuses the dots away)."""
    import re
    for key, fn in E._COMPILED.items():
        if key[1] == "advance":
            bodies = re.split(r"\n(?=\S)", fn.as_text())
            with_dots = [b for b in bodies if "dot(" in b and "ENTRY" not in b[:10]]
            if not with_dots:
                return None
            body = max(with_dots, key=lambda b: b.count("\n"))
            return len(re.findall(r"= \S+ (?:fusion|dot|copy|custom-call|sort|scatter|gather|while|conditional)\(", body))
    return None


# Memory bandwidth per device from the spec sheets (bytes/s): Cloud TPU's system-architecture pages,
# NVIDIA's data sheets (A100 80GB SXM, H100 SXM, H200 SXM).
SPEC_BANDWIDTH_BY_KIND = {
    "TPU v4": 1228e9, "TPU v5 lite": 819e9, "TPU v5e": 819e9, "TPU v5p": 2765e9, "TPU v5": 2765e9,
    "TPU v6 lite": 1640e9, "TPU v6e": 1640e9, "A100": 2039e9, "H100": 3350e9, "H200": 4800e9,
}


def spec_bandwidth() -> float | None:
    """One device's memory bandwidth from its spec sheet, or None (a CPU, an unknown device)."""
    kind = jax.devices()[0].device_kind.lower()
    return next((bw for name, bw in SPEC_BANDWIDTH_BY_KIND.items() if name.lower() in kind), None)


def copy_bandwidth(nbytes: int = 2**30, reps: int = 5) -> float:
    """Bytes/s through the device's memory: a jitted copy of `nbytes` (read once, written once),
    best of `reps`. What a memory-bound decode step can at most stream."""
    x = jnp.zeros(nbytes // 4, jnp.float32)
    copy = jax.jit(lambda x: x + 1.0)
    copy(x).block_until_ready()
    return 2 * nbytes / min(_timed(lambda: copy(x).block_until_ready()) for _ in range(reps))


def read_bandwidth(nbytes: int = 2**30, reps: int = 5) -> float:
    """Bytes/s at which a jitted product of 8 vectors with a bf16 matrix of `nbytes` reads the
    matrix (each weight read once, little written): the read a decode step does, best of `reps`.
    On a v5e chip a copy (read + write) measured 507-564 GB/s and a plain sum 459 GB/s, both below
    what a d12 decode step streamed (564 GB/s): neither bounds decode."""
    d = 8192
    w = jnp.ones((d, nbytes // (2 * d)), jnp.bfloat16)
    x = jnp.ones((8, d), jnp.bfloat16)
    product = jax.jit(lambda x, w: x @ w)
    product(x, w).block_until_ready()
    return nbytes / min(_timed(lambda: product(x, w).block_until_ready()) for _ in range(reps))


def profile_step(engine, prompt, new: int) -> None:
    """Where a batch-1 decode step's time goes: XLA:CPU's per-kernel trace events (one greedy run under
    jax.profiler), summed per step by kind, matrix products by output shape."""
    from bench.cpu import profiling
    decode_run(engine, prompt, new, temperature=0.0, chunk=4096)
    done = []
    text = next(fn.as_text() for key, fn in E._COMPILED.items() if key[1] == "advance")
    per_kind, kernels = profiling.kernel_times(
        lambda: done.append(decode_run(engine, prompt, new, temperature=0.0, chunk=4096)[2]), text)
    steps = max(done[0] - 1, 1)  # decode steps in the traced run
    per_kind = type(per_kind)({kind: us / steps for kind, us in per_kind.items()})
    profiling.print_table("one decode step", per_kind, kernels)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def decode_run(engine, prompt, new, batch=1, **kw):
    """(time to first token s, decode tok/s after the first token, tokens) for one call."""
    t0 = time.perf_counter()
    first = None
    n = 0
    for column, _ in engine.generate(prompt, batch, new, stop_tokens=(), **kw):
        if first is None:
            first = time.perf_counter()
        n += 1
    end = time.perf_counter()
    return first - t0, (n - 1) * batch / max(end - first, 1e-9), n * batch


def bench_config(args) -> tuple[str, GPTConfig]:
    if args.depth is None:
        return "config A", CONFIG_A
    return f"d{args.depth}", config_for_depth(args.depth, vocab_size=args.vocab, sequence_len=args.seq)


def bench_engine(args) -> None:
    name, cfg = bench_config(args)
    backend = jax.default_backend()
    dtype = resolve_dtype("auto")  # bf16 compute on TPU/GPU, as inference runs there
    model = random_model(cfg, dtype=dtype)
    engine = E.Engine(model)
    prompt = list(range(1, args.prompt_len + 1))
    n_matmul = matmul_param_count(model)
    cache_len = engine.plan(prompt, args.new_tokens)[2]
    # the matmul weights as the decode loop reads them: cast to the compute dtype once per call (XLA
    # hoists the cast out of the loop; on a v5e d12's bf16 decode ran at 94% of the bf16 bytes' bound)
    weight_bytes = jnp.dtype(dtype).itemsize * n_matmul
    kv_bytes = jnp.dtype(dtype).itemsize * 2 * cfg.n_layer * cfg.n_kv_head * cache_len * cfg.head_dim  # per row
    flops = 2 * n_matmul + 4 * cfg.n_layer * cfg.n_head * cfg.head_dim * cache_len
    print(f"{name}: {cfg.n_layer} layers, n_embd {cfg.n_embd}, {cfg.n_head} heads, vocab {cfg.vocab_size}; "
          f"{n_matmul / 1e6:.2f}M matmul params = {weight_bytes / 1e6:.1f} MB {jnp.dtype(dtype).name} per token step, "
          f"{flops / 1e6:.1f} MFLOP/token, cache bucket {cache_len}; {backend}, compute "
          f"{jnp.dtype(dtype).name}, {model.kernels.describe()}")

    # --- machine ---------------------------------------------------------------------------------
    step_bytes = weight_bytes + kv_bytes
    if backend == "cpu":
        peak = measured_matmul_peak()
        in_cache = bandwidth(step_bytes, cfg.n_embd)
        in_memory = bandwidth(256 * 2**20, cfg.n_embd)
        floor = matvec_floor(model)
        print(f"machine now: matmul peak {peak / 1e9:.0f} GFLOP/s; matrix-vector bytes/s (OpenBLAS, 2 threads): "
              f"{in_cache / 1e9:.0f} GB/s over {step_bytes / 1e6:.0f} MB (L3 cache), {in_memory / 1e9:.0f} GB/s over "
              f"256 MB (memory) ({load()})")
        print(f"bound, batch 1: FLOPs {peak / flops:,.0f} tok/s; bytes {in_cache / step_bytes:,.0f} tok/s with every "
              f"weight read from L3 at the best rate, {in_memory / step_bytes:,.0f} tok/s from memory; the model's "
              f"{len(model_matrices(model)[0]) + 1} matrix-vector products alone as XLA runs them: {floor:,.0f} tok/s")
        bound = min(peak / flops, in_cache / step_bytes, floor)
    else:
        peak = measured_matmul_peak(8192, jnp.bfloat16)
        copied, hbm = copy_bandwidth(), read_bandwidth()
        print(f"machine now: bf16 matmul peak {peak / 1e12:.0f} TFLOP/s; read bandwidth {hbm / 1e9:,.0f} GB/s "
              f"(8 vectors times a 1 GiB bf16 matrix), copy bandwidth {copied / 1e9:,.0f} GB/s (a copy of 1 GiB, read + write)")
        spec = spec_bandwidth()
        print(f"bound, batch 1: FLOPs {peak / flops:,.0f} tok/s; bytes {hbm / step_bytes:,.0f} tok/s "
              f"({step_bytes / 1e6:,.1f} MB read per token at the read bandwidth)"
              + (f", {spec / step_bytes:,.0f} tok/s at the spec sheet's {spec / 1e9:,.0f} GB/s" if spec else ""))
        # Against the spec sheet where known: a decode step streamed faster than the probes read
        # (d12 at 537 GB/s against a 520 GB/s probe on a v5e), so only the spec bound cannot be beaten.
        bound = min(peak / flops, (spec or hbm) / step_bytes)

    # --- compile once -----------------------------------------------------------------------------
    t = time.perf_counter()
    decode_run(engine, prompt, args.new_tokens, temperature=0.0, chunk=4096)
    compiled = len(E.compile_log)
    print(f"compile (prefill + decode loop, first call): {time.perf_counter() - t:.2f} s, "
          f"{compiled} functions: " + ", ".join(f"{k[1]} {s:.1f} s" for k, s in E.compile_log))
    kernels = step_kernels()
    if kernels is not None:
        print(f"the compiled decode step runs {kernels} kernels one after another")

    # --- batch 1 -----------------------------------------------------------------------------------
    sampled_rate = None
    for label, kw in (("greedy", dict(temperature=0.0)), ("temp 0.8 top-k 50", dict(temperature=0.8, top_k=50)),
                      ("greedy, streamed 16/call", dict(temperature=0.0, chunk=16))):
        kw.setdefault("chunk", 4096)
        runs = [decode_run(engine, prompt, args.new_tokens, seed=i, **kw) for i in range(args.repeats)]
        rates = [r[1] for r in runs]
        sampled_rate = statistics.median(rates) if "top-k" in label else sampled_rate
        ttft = [r[0] * 1e3 for r in runs]
        print(f"batch 1, {label}: decode {statistics.median(rates):,.0f} tok/s (best {max(rates):,.0f}), "
              f"first token {statistics.median(ttft):.1f} ms (best {min(ttft):.1f}), "
              f"{statistics.median(rates) / bound:.0%} of the {'spec-sheet ' if backend != 'cpu' and spec_bandwidth() else ''}"
              f"bound, {statistics.median(rates) * step_bytes / 1e9:,.0f} GB/s of weights and cache ({load()})")

    # --- batch 8 -----------------------------------------------------------------------------------
    decode_run(engine, prompt, args.new_tokens, batch=8, temperature=0.8, top_k=50, chunk=4096)  # compile
    runs = [decode_run(engine, prompt, args.new_tokens, batch=8, temperature=0.8, top_k=50, seed=i, chunk=4096)
            for i in range(args.repeats)]
    rates = [r[1] for r in runs]
    ends = [r[2] / (r[0] + r[2] / r[1]) for r in runs]  # tokens over the whole call, prefill included
    print(f"batch 8, temp 0.8 top-k 50: decode {statistics.median(rates):,.0f} tok/s (best {max(rates):,.0f}), "
          f"{statistics.median(rates) / sampled_rate:.1f}x batch 1's decode with the same sampling; "
          f"{statistics.median(ends):,.0f} tok/s end to end ({load()})")
    again = len(E.compile_log) - compiled - 2  # batch 8 compiles its own prefill and loop once
    print(f"recompiles across {3 * args.repeats + args.repeats + 1} later calls: {again}")
    if args.profile:
        profile_step(engine, prompt, args.new_tokens)


def bench_speculative(args) -> None:
    from flaxchat.loading import load_model
    main, tok, _ = load_model(args.main_run)
    draft, _, _ = load_model(args.draft_run, with_tokenizer=False)
    big, small = E.Engine(main, tok), E.Engine(draft, tok)
    prompts = [tok.encode(p, prepend=tok.bos_token_id) for p in
               ("Once upon a time", "The little dog", "One day, a girl named", "In the forest there was")]
    new = args.new_tokens
    for p in prompts[:1]:  # compile both paths once
        big.generate_batch(p, 1, new, temperature=0.0)
        big.generate_speculative(p, small, new, k=args.k)
    plain_t = spec_t = 0.0
    accepted = proposed = tokens = 0
    for p in prompts:
        t = time.perf_counter()
        ref, _ = big.generate_batch(p, 1, new, temperature=0.0)
        plain_t += time.perf_counter() - t
        t = time.perf_counter()
        out, stats = big.generate_speculative(p, small, new, k=args.k)
        spec_t += time.perf_counter() - t
        assert out == ref[0], "speculative output differs from greedy"
        accepted, proposed, tokens = accepted + stats["accepted"], proposed + stats["proposed"], tokens + len(out)
    print(f"speculative (main {main.config.n_layer}L/{main.config.n_embd}d, draft {draft.config.n_layer}L/"
          f"{draft.config.n_embd}d, k={args.k}, greedy, {len(prompts)} prompts, {tokens} tokens): acceptance "
          f"{accepted / max(proposed, 1):.0%}, plain {tokens / plain_t:,.0f} tok/s, speculative "
          f"{tokens / spec_t:,.0f} tok/s, speed-up {plain_t / spec_t:.2f}x, output identical ({load()})")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--depth", type=int, default=None, help="the depth preset to decode with (default: config A)")
    p.add_argument("--vocab", type=int, default=32768, help="with --depth: vocabulary size (default 32768)")
    p.add_argument("--seq", type=int, default=2048, help="with --depth: context length (default 2048)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (default 16)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per call (default 128)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per figure; the median and best are printed")
    p.add_argument("--main-run", default=None, help="trained run folder for the speculative benchmark")
    p.add_argument("--draft-run", default=None, help="smaller run folder with the same tokenizer (the draft)")
    p.add_argument("-k", type=int, default=4, help="draft tokens per round")
    p.add_argument("--profile", action="store_true",
                   help="also print where a decode step's time goes, kernel by kernel (XLA:CPU trace)")
    args = p.parse_args(argv)
    if min(args.prompt_len, args.new_tokens, args.repeats, args.k, args.vocab, args.seq) < 1 or (args.depth or 1) < 1:
        raise UserError("--depth, --vocab, --seq, --prompt-len, --new-tokens, --repeats and -k must be at least 1.")
    name, cfg = bench_config(args)
    if args.prompt_len >= cfg.sequence_len:
        raise UserError(f"--prompt-len must be below {name}'s context of {cfg.sequence_len} tokens.")
    if args.profile:  # read when the CPU backend starts, i.e. before the first computation
        from bench.cpu import profiling
        profiling.enable()
    bench_engine(args)
    if args.main_run and args.draft_run:
        bench_speculative(args)
    else:
        print("speculative: pass --main-run and --draft-run (two trained runs sharing a tokenizer) to measure it")


if __name__ == "__main__":
    import sys

    from flaxchat.errors import cli_main
    sys.exit(cli_main(main))
