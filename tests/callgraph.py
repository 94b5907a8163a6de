"""The call graph of the native engine (native/*.c), from its sources: which function
calls which, and which file calls which. No compiler needed: comments, strings and
preprocessor lines are blanked, function definitions are found at brace depth 0, and a
call is a name defined in native/ followed by "(" inside a body. Calls through function
pointers (the callbacks an upper layer registers, pc_owner and pc_unit) are not calls
here: that is how a lower layer reaches an upper one without depending on it.

    python tests/callgraph.py            # prints the file graph and its layers
"""
from __future__ import annotations

import os
import re
from typing import Dict, List, Optional, Set, Tuple

NATIVE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "native")
_DEF = re.compile(r"(\w+)\s*\([^;{}]*\)\s*(?:__attribute__\s*\(\(.*?\)\)\s*)?$", re.S)
_CALL = re.compile(r"\b(\w+)\s*\(")
_KEYWORDS = {"if", "for", "while", "switch", "return", "sizeof", "defined"}


def _blank(text: str) -> str:
    """Comments, string and character literals and preprocessor lines as spaces (the
    offsets and the newlines stay)."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j += 1
        elif c == "#" and (i == 0 or text[i - 1] == "\n"):
            j = i
            while j < n and (text[j] != "\n" or text[j - 1] == "\\"):
                j += 1
        else:
            out.append(c)
            i += 1
            continue
        out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
        i = j
    return "".join(out)


def functions(path: str) -> Dict[str, str]:
    """name -> body of every function defined in one C file."""
    text = _blank(open(path).read())
    found, depth, head_start, i = {}, 0, 0, 0
    while i < len(text):
        c = text[i]
        if c == "{":
            if depth == 0:
                m = _DEF.search(text[head_start:i].rstrip())
                if m and m.group(1) not in _KEYWORDS:
                    start, level = i, 0
                    while True:                       # the body's end
                        level += {"{": 1, "}": -1}.get(text[i], 0)
                        if level == 0:
                            break
                        i += 1
                    found[m.group(1)] = text[start:i + 1]
                    head_start = i + 1
                    i += 1
                    continue
            depth += 1
        elif c == "}":
            depth -= 1
        elif c == ";" and depth == 0:
            head_start = i + 1
        i += 1
    return found


def graph(native: str = NATIVE) -> Tuple[Dict[str, str], Dict[str, Set[str]], Dict[str, Set[str]]]:
    """(function -> its file, function -> functions it calls, file -> files it calls)."""
    where: Dict[str, str] = {}
    bodies: Dict[str, str] = {}
    for name in sorted(os.listdir(native)):
        if name.endswith(".c"):
            for fn, body in functions(os.path.join(native, name)).items():
                where[fn], bodies[fn] = name, body
    calls = {fn: {c for c in _CALL.findall(body) if c in where and c != fn} for fn, body in bodies.items()}
    files: Dict[str, Set[str]] = {f: set() for f in set(where.values())}
    for fn, callees in calls.items():
        files[where[fn]] |= {where[c] for c in callees if where[c] != where[fn]}
    return where, calls, files


def cycle(edges: Dict[str, Set[str]]) -> Optional[List[str]]:
    """A cycle of the directed graph (its nodes, the first repeated at the end), or None."""
    state: Dict[str, int] = {}
    stack: List[str] = []

    def visit(v: str) -> Optional[List[str]]:
        state[v] = 1
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(edges):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def layers(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The files bottom up: each layer calls only the layers below it (an acyclic graph)."""
    left, placed, out = set(edges), set(), []
    while left:
        layer = sorted(f for f in left if edges[f] <= placed)
        if not layer:
            raise ValueError(f"a cycle: {cycle(edges)}")
        out.append(layer)
        placed |= set(layer)
        left -= set(layer)
    return out


def via(calls: Dict[str, Set[str]], where: Dict[str, str], a: str, b: str) -> List[str]:
    """The calls that make file a depend on file b ("caller -> callee")."""
    return sorted(f"{fn} -> {c}" for fn, cs in calls.items() if where[fn] == a for c in cs if where[c] == b)


if __name__ == "__main__":
    where, calls, files = graph()
    for i, layer in enumerate(layers(files)):
        print(f"layer {i}: " + ", ".join(f"{f} -> {', '.join(sorted(files[f])) or '-'}" for f in layer))
