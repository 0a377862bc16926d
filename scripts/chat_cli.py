"""Chat with a trained model in the terminal: multi-turn, replies streamed as they are written.

    python -m scripts.chat_cli --run-dir runs/chat/sft -p "Hello"             # a chat model replies
    python -m scripts.chat_cli --run-dir runs/tinystories -p "Once upon a time"  # a base model continues
    python -m scripts.chat_cli --run-dir runs/chat/rl                         # interactive

A model finetuned by scripts.sft or scripts.rl chats; a base model (pretraining only) continues
the text it is given, since it never learnt the chat template. The mode is printed; `--mode`
overrides it. `--run-dir` also takes a checkpoints folder or one step folder. Type `clear` to
start a new conversation, `quit` (or Ctrl-D) to leave. The model may call its Python tool; the
engine runs it (calculator, else the sandbox) and the output appears in the reply.
"""

from __future__ import annotations

import math
import sys

from flaxchat.chat_mode import MODE_HELP, MODES
from flaxchat.config import ArgumentParser
from flaxchat.errors import UserError, cli_main
from flaxchat.execution import SANDBOX_CHOICES, SANDBOX_HELP


def parse_args(argv=None):
    p = ArgumentParser(prog="python -m scripts.chat_cli", description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", "-i", required=True, help="run folder (local or gs://), its checkpoints/ folder, or a checkpoints/<step> folder")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("-p", "--prompt", default=None, help="answer this one prompt and exit")
    p.add_argument("-t", "--temperature", type=float, default=0.6, help="0 for greedy (default: 0.6)")
    p.add_argument("-k", "--top-k", type=int, default=50, help="sample among the k likeliest tokens, 0 for all (default: 50)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (default: off)")
    p.add_argument("--max-tokens", type=int, default=256, help="longest reply in tokens (default: 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-tools", action="store_true", help="do not run the model's Python tool calls")
    p.add_argument("--sandbox", default="strict", choices=SANDBOX_CHOICES, help=SANDBOX_HELP + " (default: strict)")
    p.add_argument("--mode", default="auto", choices=MODES, help=MODE_HELP + " (default: auto)")
    return p.parse_args(argv)


def check_sampling(args) -> None:
    """What `engine.make_sampling` does not check: NaN fails every comparison, so `temperature < 0`
    let -t nan through silently (top_p's range check already refuses it)."""
    if not 0 <= args.temperature < math.inf:
        raise UserError(f"-t/--temperature must be 0 (greedy) or a positive number (got {args.temperature}).")
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be at least 1 (got {args.max_tokens}).")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.prompt is not None and not args.prompt.strip():
        raise UserError("the prompt given with -p is empty; write something to say to the model.")
    check_sampling(args)

    # --- model, tokenizer, engine ---------------------------------------------------------------
    from flaxchat import chat_mode
    from flaxchat.engine import Engine, make_sampling
    from flaxchat.loading import chat_prompt, load_model, stream_text
    make_sampling(args.temperature, args.top_k, args.top_p)  # bad values fail before the model loads
    model, tokenizer, meta = load_model(args.run_dir, args.step)
    engine = Engine(model, tokenizer, tools=not args.no_tools, sandbox=args.sandbox)
    sampling = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    mode, why = chat_mode.resolve(meta, args.mode)
    print(why, file=sys.stderr if args.prompt is not None else sys.stdout, flush=True)

    def reply(messages, turn) -> str:
        if mode == "chat":
            prompt, lead = chat_prompt(tokenizer, messages), ""
        else:  # the text itself, continued: the continuation follows it on the same line
            prompt, lead = chat_mode.completion_prompt(tokenizer, messages[-1]["content"]), messages[-1]["content"]
        pieces = []
        for piece in stream_text(engine, tokenizer, prompt, seed=args.seed + turn, **sampling):
            print(lead + piece, end="", flush=True)  # the text with the first piece: after compile messages
            lead = ""
            pieces.append(piece)
        print(lead, flush=True)
        return "".join(pieces)

    # --- one prompt ----------------------------------------------------------------------------
    if args.prompt is not None:
        reply([{"role": "user", "content": args.prompt}], 0)
        return 0

    if mode == "complete":
        return complete_loop(args, model, meta, reply)

    # --- conversation loop ---------------------------------------------------------------------
    print(f"chatting with {args.run_dir} (step {meta.get('step')}, {model.config.n_layer} layers, "
          f"context {model.config.sequence_len} tokens). 'clear' starts over, 'quit' or Ctrl-D leaves.")
    messages: list[dict] = []
    turn = 0
    while True:
        try:
            text = input("\nUser: ").strip()
        except EOFError:
            print()
            return 0
        if text.lower() in ("quit", "exit"):
            return 0
        if text.lower() == "clear":
            messages = []
            print("(new conversation)")
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        print("Assistant: ", end="", flush=True)
        try:
            answer = reply(messages, turn)
        except UserError as e:  # e.g. the conversation outgrew the context: say so, keep the session
            messages.pop()
            print(f"\nerror: {e} Type 'clear' to start a new conversation.", flush=True)
            continue
        messages.append({"role": "assistant", "content": answer})
        turn += 1


def complete_loop(args, model, meta, reply) -> int:
    """A base model: each line typed is a text to continue; nothing carries over between lines."""
    print(f"continuing text with {args.run_dir} (step {meta.get('step')}, {model.config.n_layer} layers, "
          f"context {model.config.sequence_len} tokens). 'quit' or Ctrl-D leaves.")
    turn = 0
    while True:
        try:
            text = input("\nText: ").strip()
        except EOFError:
            print()
            return 0
        if text.lower() in ("quit", "exit"):
            return 0
        if not text:
            continue
        try:
            reply([{"role": "user", "content": text}], turn)
        except UserError as e:  # e.g. a text longer than the context: say so, keep the session
            print(f"\nerror: {e}", flush=True)
        turn += 1


if __name__ == "__main__":
    sys.exit(cli_main(main))
