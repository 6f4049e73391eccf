"""Static bounds on what a constraint may be before llguidance's native code sees it.

llguidance compiles grammars and JSON schemas recursively, on the calling thread's stack,
and a deep enough input overflows it: a segfault that takes the whole process down. On an
8 MiB stack (the main thread's and Python's threads' default here) these crashed it:

    JSON schema, objects linked through $ref     ~920 levels  (~1,840 schema nodes deep)
    JSON schema, plain $ref chain                ~2,500 links
    Lark grammar, rules chained one to the next   ~2,700 rules (terminals: ~3,400)
    GBNF grammar, the same chain                  ~3,500 rules

These bounds refuse such inputs before any compile, each with a ConfigError naming the
limit and the value; they sit 10-20x below those thresholds (the compile in the child,
constraint_compiler.py, runs on a 2 MiB stack, so it crashes at about a quarter of them:
anything it passes has 4x headroom in a worker). Sizes are bounded too: llguidance's
compile time grows faster than linearly with a grammar's alternatives and a schema's
properties: a 200 KB schema of 5,000 properties took 0.9 s to validate and 4.4 s to build
a matcher against SmolLM2's 49k-token vocabulary, one of 2,500 (114 KB) 1.0 s; GBNF->Lark
conversion is quadratic pure Python. Past 128 KiB nothing is refused that could be served
quickly.

Everything here is linear and iterative: no recursion on client input.
"""

from __future__ import annotations

import json
import re
from typing import Any

from minivllm.errors import ConfigError

MAX_CONSTRAINT_BYTES = 128 * 1024  # a schema's JSON text, a grammar, a regex, a choice list's JSON
MAX_CHOICES = 10_000  # guided_choice entries
MAX_JSON_DEPTH = 100  # nesting of client JSON ({ and [); llguidance's own parser stops at 128
MAX_SCHEMA_DEPTH = 128  # schema nodes along the deepest path, following $ref
MAX_RULE_DEPTH = 256  # grammar rules along the deepest chain of references

SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SUBSCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                 "unevaluatedItems", "unevaluatedProperties", "additionalItems")


def json_depth(value: Any) -> int:
    """How deeply `value` (parsed JSON) nests objects and arrays; a scalar is 0."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def json_text_depth(text: str) -> int:
    """How deeply JSON text nests objects and arrays, counted without parsing it (a
    parser may run out of stack first): brackets outside strings."""
    deepest = depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def check_json_depth(field: str, value: Any) -> None:
    depth = json_depth(value)
    if depth > MAX_JSON_DEPTH:
        raise ConfigError(field, f"<JSON nested {depth} levels deep>",
                          f"is nested too deeply: the limit is {MAX_JSON_DEPTH} levels of objects and arrays")


def loads_client_json(field: str, text: str) -> Any:
    """Client JSON text, parsed, with its depth checked first: Python's parser raises
    RecursionError (not ValueError) on deep enough input."""
    depth = json_text_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ConfigError(field, f"<JSON text nested {depth} levels deep>",
                          f"is nested too deeply: the limit is {MAX_JSON_DEPTH} levels of objects and arrays")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ConfigError(field, text[:80], f"is not valid JSON: {exc}") from None


def check_size(field: str, size: int, what: str = "bytes") -> None:
    if size > MAX_CONSTRAINT_BYTES:
        raise ConfigError(field, f"<{size} {what}>", f"is too large: the limit is {MAX_CONSTRAINT_BYTES} bytes")


def _local_ref(root: dict, ref: Any) -> Any:
    """What a "#/..." reference points at in `root`, or None (llguidance reports the rest)."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        return None
    node: Any = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _subschemas(node: dict) -> list:
    out = []
    for key in SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out += list(node[key].values())
    for key in SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out += node[key]
    for key in SUBSCHEMA_ONE:
        out.append(node.get(key))
    if isinstance(node.get("items"), list):  # draft 4's tuple form
        out += node["items"]
    return [s for s in out if isinstance(s, dict)]


def longest_path(roots: list, children, key=id) -> int:
    """Nodes on the longest path from any root through `children(node)`; a node reached
    again while its own path is open (a cycle: llguidance compiles it lazily) adds 0.
    Iterative, each node (told apart by `key`) expanded once."""
    memo: dict[Any, int] = {}
    open_nodes: set = set()
    best: dict[Any, int] = {}
    for root in roots:
        if key(root) in memo:
            continue
        stack = [(root, iter(children(root)))]
        open_nodes.add(key(root))
        best[key(root)] = 0
        while stack:
            node, todo = stack[-1]
            child = next(todo, None)
            if child is None:
                stack.pop()
                open_nodes.discard(key(node))
                memo[key(node)] = 1 + best.pop(key(node))
                if stack:
                    parent = key(stack[-1][0])
                    best[parent] = max(best[parent], memo[key(node)])
                continue
            if key(child) in memo or key(child) in open_nodes:
                best[key(node)] = max(best[key(node)], memo.get(key(child), 0))
                continue
            open_nodes.add(key(child))
            best[key(child)] = 0
            stack.append((child, iter(children(child))))
    return max(memo.values(), default=0)


def schema_depth(schema: Any) -> int:
    """Schema nodes along the deepest path of `schema`, nested subschemas and $ref hops
    alike (what llguidance's compile recurses through)."""
    if not isinstance(schema, dict):
        return 0

    def children(node: dict) -> list:
        target = _local_ref(schema, node.get("$ref"))
        return _subschemas(node) + ([target] if isinstance(target, dict) else [])

    return longest_path([schema], children)


def check_schema(field: str, schema: Any) -> None:
    """The bounds on a JSON schema (as parsed JSON)."""
    check_json_depth(field, schema)
    depth = schema_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ConfigError(field, f"<schema {depth} levels deep through nesting and $ref>",
                          f"is nested too deeply: the limit is {MAX_SCHEMA_DEPTH} levels of subschemas and $ref links")
    check_size(field, len(json.dumps(schema, ensure_ascii=False).encode("utf-8", "surrogatepass")))


# -- grammars ---------------------------------------------------------------------------

_GBNF_NAME = re.compile(r"[A-Za-z0-9_-]+")
_JSON = json.JSONDecoder()


def _skip_quoted(text: str, at: int, close: str) -> int:
    """The index past the `close` that ends the quoted run opening at `at` (escapes honoured)."""
    i = at + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == close:
            return i + 1
        else:
            i += 1
    return i


# One pass over a Lark grammar, with no token list (a grammar of thousands of rules would
# otherwise leave tens of thousands of tuples for the controller's garbage collector):
# comments, strings and regexes are skipped whole; a name followed by ":" at a line's start
# (after ? or !, a .priority or [attributes]) defines a rule; any other name is a reference.
_LARK_SCAN = re.compile(
    r"""
    (?P<skip> //[^\n]* | \#[^\n]* | "(?:\\.|[^"\\\n])*" | '(?:\\.|[^'\\\n])*' | /(?:\\.|[^/\\\n])+/ )
  | (?P<directive> %[A-Za-z_]+ )
  | (?P<define> ^[ \t]*[?!]?(?P<defined>[A-Za-z_][A-Za-z0-9_]*)[ \t]*
                (?:\.[ \t]*-?[0-9]+[ \t]*)?(?:\[[^\]\n]*\][ \t]*)?:(?!:) )
  | (?P<name> [A-Za-z_][A-Za-z0-9_]* )
""",
    re.VERBOSE | re.MULTILINE,
)


def lark_rules(field: str, text: str) -> dict[str, set[str]]:
    """Each rule or terminal of a Lark grammar -> the names its definition mentions. A
    `%json` schema inside it is checked against the schema bounds here."""
    rules: dict[str, set[str]] = {}
    current: set[str] | None = None
    at = 0
    while (m := _LARK_SCAN.search(text, at)) is not None:
        at = m.end()
        if m.group("define"):
            current = rules.setdefault(m.group("defined"), set())
        elif m.group("name"):
            if current is not None:
                current.add(m.group("name"))
        elif m.group("directive"):
            brace = at
            while brace < len(text) and text[brace] in " \t":
                brace += 1
            if brace < len(text) and text[brace] == "{":  # %json {...} or %llguidance {...}
                try:
                    value, at = _JSON.raw_decode(text, brace)
                except (ValueError, RecursionError):  # llguidance reports the bad JSON
                    continue
                if m.group("directive") == "%json":
                    check_schema(f"{field} (a %json schema)", value)
    return rules


def gbnf_rules(text: str) -> dict[str, set[str]]:
    """Each rule of a GBNF grammar -> the names its definition mentions."""
    rules: dict[str, list[str]] = {}
    current, last_name, i = None, None, 0
    while i < len(text):
        ch = text[i]
        if ch == "#":
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
        elif ch == '"':
            i = _skip_quoted(text, i, '"')
        elif ch == "[":
            i = _skip_quoted(text, i, "]")
        elif text.startswith("::=", i):
            if last_name is not None:
                if current:
                    current.pop()  # the name just read names this rule: not a reference of the last
                current = rules.setdefault(last_name, [])
            i += 3
        elif ch.isalnum() or ch in "_-":
            m = _GBNF_NAME.match(text, i)
            last_name = m.group(0)
            if current is not None:
                current.append(last_name)
            i = m.end()
        else:
            if not ch.isspace():
                last_name = None
            i += 1
    return {name: set(refs) for name, refs in rules.items()}


def rule_depth(rules: dict[str, set[str]]) -> int:
    """Rules along the longest chain of references (a rule reached again on its own chain,
    recursion, adds 0)."""
    return longest_path(list(rules), lambda name: [r for r in rules[name] if r in rules], key=lambda name: name)


def check_grammar(field: str, text: str, is_lark: bool) -> None:
    """The bounds on a grammar's text: size, and the depth of its rule chains (and of its
    embedded %json schemas)."""
    check_size(field, len(text.encode("utf-8", "surrogatepass")))
    depth = rule_depth(lark_rules(field, text) if is_lark else gbnf_rules(text))
    if depth > MAX_RULE_DEPTH:
        raise ConfigError(field, f"<grammar whose rules chain {depth} deep>",
                          f"chains rules too deeply: the limit is {MAX_RULE_DEPTH} rules, each referring to the next")


def check_choices(field: str, choices: list) -> None:
    if len(choices) > MAX_CHOICES:
        raise ConfigError(field, f"<{len(choices)} choices>", f"has too many entries: the limit is {MAX_CHOICES}")
    check_size(field, sum(len(c.encode("utf-8", "surrogatepass")) + 4 for c in choices))
