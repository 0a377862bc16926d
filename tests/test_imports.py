"""Imports run one way: errors/config -> ops -> kernels -> gpt/optim -> train -> scripts, with
flaxchat.cloud and flaxchat.remote side by side over flaxchat.runner. The walk reads every import
statement of flaxchat/**/*.py (module level and inside functions: a lazy import is still a
dependency) and fails on a circle, printing it. Checking flags imports no JAX."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "numpy")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "flaxchat").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """flaxchat module -> the flaxchat modules it imports (a `from pkg import name` counts as
    `pkg.name` where that is a module, else as `pkg`)."""
    modules = _modules()

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps |= {known(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    package = package[:len(package) - node.level + 1]
                    base = ".".join(package + ([base] if base else []))
                deps |= {known(f"{base}.{a.name}") if f"{base}.{a.name}" in modules else known(base)
                         for a in node.names}
        graph[name] = {d for d in deps if d and d != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of modules, as a path a -> b -> ... -> a."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm; the package has ~130 modules, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for group in groups:  # a shortest way back to the start, through the group only
        start = min(group)
        paths, seen = [[start]], {start}
        while paths:
            path = paths.pop(0)
            nxt = sorted(graph[path[-1]] & group)
            if start in nxt:
                found.append(path + [start])
                break
            for w in nxt:
                if w not in seen:
                    seen.add(w)
                    paths.append(path + [w])
    return found


def test_the_package_has_no_import_circle():
    graph = import_graph()
    found = circles(graph)
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports, {len(found)} circles")
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_the_walk_sees_a_circle_and_prints_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c", "a"]]


def test_layers_import_only_downwards():
    """The layers the house names, checked as edges: a lower one never imports a higher one."""
    graph = import_graph()
    order = ["flaxchat.errors", "flaxchat.config", "flaxchat.ops", "flaxchat.kernels", "flaxchat.optim",
             "flaxchat.gpt", "flaxchat.train"]

    def layer(m):
        for i, name in enumerate(order):
            if m == name or m.startswith(name + "."):
                return i
        return None

    bad = [f"{m} -> {d}" for m, deps in graph.items() for d in deps
           if layer(m) is not None and layer(d) is not None and layer(d) > layer(m)]
    assert not bad, bad
    for a, b in (("flaxchat.cloud", "flaxchat.remote"), ("flaxchat.remote", "flaxchat.cloud")):
        crossing = [f"{m} -> {d}" for m, deps in graph.items() if m.startswith(a)
                    for d in deps if d.startswith(b)]
        assert not crossing, f"{a} and {b} sit side by side over flaxchat.runner: {crossing}"


def test_flag_checking_knows_every_attention_kernel():
    from flaxchat import kernels
    from flaxchat.config import ATTENTION_NAMES
    assert kernels.attention_names() == ATTENTION_NAMES


@pytest.mark.timeout(60)
@pytest.mark.parametrize("script", ["pretrain", "sft", "rl", "run_tinystories"])
def test_help_and_a_bad_flag_answer_without_jax(script):
    probe = ("import runpy, sys\n"
             "sys.argv = ['x'] + sys.argv[1:]\n"
             "try:\n"
             f"    runpy.run_module('scripts.{script}', run_name='__main__')\n"
             "except SystemExit as e:\n"
             "    code = e.code\n"
             f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r})\n"
             "print('EXIT', code, 'HEAVY', heavy, file=sys.stderr)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for argv, code in ((["--help"], 0), (["--no-such-flag"], 2), (["--depth", "two"], 2)):
        r = subprocess.run([sys.executable, "-c", probe, *argv], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=50)
        last = r.stderr.strip().splitlines()[-1]
        assert last == f"EXIT {code} HEAVY []", (argv, r.stderr[-2000:])
        if code:
            assert "Traceback" not in r.stderr and r.stderr.startswith("error: ") and r.stderr.count("\n") == 2, r.stderr
