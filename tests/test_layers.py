"""The native engine's units call one way (tests/callgraph.py reads the C sources), and
partialcoll._errors does not import the binding: a test fails if a cycle comes back."""
import ast
import os

import callgraph

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_native_files_call_one_way():
    where, calls, files = callgraph.graph()
    assert len(where) > 150 and "sched_progress" in where, "the call graph found too few functions"
    loop = callgraph.cycle(files)
    if loop:
        why = {f"{a} -> {b}": callgraph.via(calls, where, a, b) for a, b in zip(loop, loop[1:])}
        raise AssertionError(f"native/ has a cycle of calls between files: {' -> '.join(loop)}: {why}")
    assert callgraph.layers(files)[0] == ["clock.c", "errors.c"]


def test_each_layer_knows_only_what_is_below():
    _, _, files = callgraph.graph()
    assert files["mpi.c"] <= {"errors.c"}, files["mpi.c"]                       # messages, not schedules
    assert not files["sched.c"] & {"coll.c", "avg.c", "hop.c"}, files["sched.c"]  # not partial collectives
    assert not files["progress.c"] & {"sched.c", "mpi.c", "coll.c", "avg.c", "hop.c"}, files["progress.c"]
    for upper in ("coll.c", "avg.c", "hop.c"):                                   # built on schedules
        assert "sched.c" in files[upper] and not files[upper] & {"coll.c", "avg.c", "hop.c"} - {upper}


def test_cycle_finder_finds_cycles():
    assert callgraph.cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert callgraph.cycle({"a": {"b"}, "b": set()}) is None


def test_errors_module_does_not_import_the_binding():
    tree = ast.parse(open(os.path.join(ROOT, "partialcoll", "_errors.py")).read())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert not imported & {"_lib", "_engine", "_native", "_status", "mpi4py"}, imported
