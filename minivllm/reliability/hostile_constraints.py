"""The constraint shapes that once crashed or stalled the server (issue 39), built at a
chosen size: the hardening tests send them scaled as the limits need, and
`scripts/probe_hostile_constraints.py` sends each at the size seen in the wild and at twice
it, timing the 400 and the other streams' TTFT meanwhile.

Each builder returns the request fields to merge into a chat completion body.
"""

from __future__ import annotations

import json


def ref_objects(n: int) -> dict:
    """A JSON schema whose objects link through `$ref` n levels deep (n = 1000: 94 KB)."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def ref_plain(n: int) -> dict:
    """A plain `$ref` chain n links long."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def lark_chain(n: int) -> str:
    """A Lark grammar whose rules chain n deep."""
    return "start: r0\n" + "".join(f'r{i}: "a" r{i + 1}\n' for i in range(n)) + f'r{n}: "b"\n'


def gbnf_chain(n: int) -> str:
    """The same chain in GBNF (converted to Lark before llguidance sees it)."""
    return "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1}\n' for i in range(n)) + f'r{n} ::= "b"\n'


def gbnf_alternatives(n: int) -> str:
    """One GBNF rule of n alternatives (n = 30,000: ~290 KB; the conversion was superlinear)."""
    return "root ::= " + " | ".join(f'"w{i}"' for i in range(n))


def schema_format(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


def deep_json_text(n: int) -> str:
    """JSON text nested n arrays deep (n = 100,000 raised RecursionError: a 500)."""
    return "[" * n + "]" * n


def shapes(scale: float = 1.0) -> dict[str, dict]:
    """Each hostile shape at `scale` times the size that crashed or stalled the server."""
    def n(x: int) -> int:
        return max(1, int(x * scale))

    return {
        "ref-objects": schema_format(ref_objects(n(1000))),
        "ref-plain": schema_format(ref_plain(n(3000))),
        "lark-chain": {"guided_grammar": lark_chain(n(2800))},
        "gbnf-chain": {"guided_grammar": gbnf_chain(n(4000))},
        "gbnf-alternatives": {"guided_grammar": gbnf_alternatives(n(28_000))},
        "lark-%json": {"structured_outputs": {"grammar": "start: x\nx: %json " + json.dumps(ref_objects(n(1000)))}},
        "choice": {"guided_choice": [f"option {i}" for i in range(n(100_000))]},
        "guided-json-deep": {"guided_json": deep_json_text(n(100_000))},
        "tool-ref-chain": {"tools": [{"type": "function", "function": {"name": "f", "parameters": ref_plain(n(3000))}}],
                           "tool_choice": "required"},
    }
