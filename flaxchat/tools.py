"""The Python tool of the chat model: a safe calculator first, the sandbox otherwise.

nanochat's model learns to write `<|python_start|>expr<|python_end|>`; the engine evaluates `expr`
and forces `<|output_start|>result<|output_end|>` into that sample's stream. The calculator here
walks the syntax tree and allows only numbers, arithmetic and `"text".count("t")`, so most calls
never start a process (~0.1 s each for the sandbox); anything else goes to `flaxchat.execution`.
"""

from __future__ import annotations

import ast
import operator
import warnings
from typing import Callable

from flaxchat.execution import execute_code

MAX_INT_BITS = 4096  # refuse 9**9**9-style blow-ups in the calculator (the sandbox bounds the rest)
MAX_RESULT_CHARS = 200

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class _Refuse(Exception):
    """Not something the calculator evaluates: hand it to the sandbox."""


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, str):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_num(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _num(node.left), _num(node.right)
        if isinstance(node.op, ast.Pow) and isinstance(b, int) and abs(b) > 64 and abs(a) > 1:
            raise _Refuse
        return _check(_BINOPS[type(node.op)](a, b))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "count"
            and not node.keywords and len(node.args) == 1):
        text, sub = _eval(node.func.value), _eval(node.args[0])
        if isinstance(text, str) and isinstance(sub, str):
            return text.count(sub)
    raise _Refuse


def _num(node):
    value = _eval(node)
    if isinstance(value, str):
        raise _Refuse
    return value


def _check(value):
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise _Refuse
    if isinstance(value, complex):
        raise _Refuse
    return value


def calculate(expr: str) -> str | None:
    """The value of a plain arithmetic or `"s".count("x")` expression as text, or None when the
    expression is anything else (or fails): then the sandbox runs it."""
    expr = expr.strip()
    if not expr or len(expr) > 1000:
        return None
    if not any(q in expr for q in "\"'"):
        expr = expr.replace(",", "")  # "1,234 * 5": thousands separators, as nanochat strips them
    try:
        with warnings.catch_warnings():  # a sampled "3a+1" is a SyntaxWarning before it is an error
            warnings.simplefilter("ignore", SyntaxWarning)
            tree = ast.parse(expr, mode="eval")
        value = _eval(tree)
    except (_Refuse, SyntaxError, ArithmeticError, ValueError, TypeError, RecursionError, MemoryError):
        return None
    return str(value)


def run_tool(expr: str, timeout: float = 3.0, sandbox: str = "best-effort") -> str:
    """Calculator first, else the sandbox (`sandbox`: see flaxchat.execution.SANDBOX_HELP); always
    returns a short text (errors included)."""
    result = calculate(expr)
    if result is None:
        result = execute_code(expr, timeout=timeout, sandbox=sandbox).summary(MAX_RESULT_CHARS)
    return result[:MAX_RESULT_CHARS]


class ToolState:
    """One sample's view of the stream: collects the tokens between <|python_start|> and
    <|python_end|>, and when the block closes returns the tokens to force next."""

    def __init__(self, tokenizer, runner: Callable[[str], str], max_tokens: int):
        self.tokenizer = tokenizer
        self.runner = runner
        self.max_tokens = max_tokens
        self.start = tokenizer.encode_special("<|python_start|>")
        self.end = tokenizer.encode_special("<|python_end|>")
        self.out_start = tokenizer.encode_special("<|output_start|>")
        self.out_end = tokenizer.encode_special("<|output_end|>")
        self.expr: list[int] | None = None  # None: outside a python block
        self.calls: list[tuple[str, str]] = []  # (expression, result), for callers and tests

    def feed(self, token: int) -> list[int] | None:
        if token == self.start:
            self.expr = []
        elif token == self.end and self.expr is not None:
            expr = self.tokenizer.decode(self.expr)
            self.expr = None
            result = self.runner(expr)
            self.calls.append((expr, result))
            body = self.tokenizer.encode(result)[: self.max_tokens - 2]
            return [self.out_start, *body, self.out_end]
        elif self.expr is not None:
            self.expr.append(token)
        return None
