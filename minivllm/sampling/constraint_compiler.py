"""A constraint's llguidance grammar, compiled (and checked) in a child process that may
die alone, within a time budget.

    grammar = compile_constraint("guided_grammar", "grammar", text)   # the text llguidance accepted

constraint_limits.py refuses the inputs known to overflow llguidance's stack before they
get here; this is the net for the shapes no bound foresaw. The child compiles on a
thread with a 2 MiB stack, a quarter of a worker's, so a grammar that passes here has
4x headroom where the worker compiles it against the vocabulary. A compile that crashes
the child, or outlasts COMPILE_BUDGET_S (the child is then killed), is a ConfigError
naming the field: the client's error, a 400, never the server's. Pure-Python steps
(llguidance's GBNF->Lark conversion is quadratic) also run there, off the controller's
GIL, so they slow no other request.

Measured on the 2-core dev box: a round trip to a warm child adds ~0.2 ms; starting one
(Python + llguidance) ~0.1 s, once. POOL_SIZE children serve compiles in parallel.

`python -m minivllm.sampling.constraint_compiler` is the child: one JSON request a line
on stdin ({"kind", "value"}), one JSON answer a line on stdout ({"grammar"} or {"error"}).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
import time

from minivllm.errors import ConfigError

COMPILE_BUDGET_S = 1.5  # so a refusal for time still comes within 2 s
POOL_SIZE = 2
CHILD_STACK_BYTES = 2 << 20
CHILD_NICENESS = 10
# Compact JSON ("," and ":" with no whitespace around them): a model asked for JSON cannot
# then spend its whole budget on whitespace, a known failure of free-whitespace JSON modes.
JSON_OPTIONS = {"whitespace_flexible": False}


def llguidance_grammar(kind: str, value) -> str:
    """The llguidance grammar text of a constraint of `kind` (structured.KINDS); the
    conversion only, no compile."""
    import llguidance as llg

    if kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(value)
    if kind == "grammar":
        return llg.grammar_from("grammar", value)  # Lark, or GBNF (told apart by llguidance)
    # One terminal whose alternatives are the choices: llguidance's own "choice" grammar
    # makes each an Earley item of one row, and a row holds at most 2,000 (LLParserLimits'
    # max_items_in_row), so 2,000 choices or more failed at the first token. As one lexeme
    # 10,000 compile in ~0.1 s and match exactly the same strings.
    return llg.grammar_from("lark", "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in value))


def compile_here(kind: str, value) -> dict:
    """{"grammar": text} when llguidance accepts the constraint, else {"error": why}."""
    import llguidance as llg

    try:
        grammar = llguidance_grammar(kind, value)
        error = llg.LLMatcher.validate_grammar(grammar)
    except (ValueError, RecursionError) as exc:  # the converters refuse some inputs outright
        return {"error": str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}
    if error and not error.startswith("WARNING"):
        return {"error": error.strip()}
    return {"grammar": grammar}


class _Child:
    def __init__(self):
        env = dict(os.environ)
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([sys.executable, "-m", "minivllm.sampling.constraint_compiler"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        self._buffer = b""

    def ask(self, request: bytes, deadline: float) -> dict | str:
        """The child's answer, or "timeout" / "died" (then the child is gone)."""
        try:
            self.proc.stdin.write(request)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            return self._gone("died")
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return self._gone("timeout")
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    return self._gone("died")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def _gone(self, why: str) -> str:
        self.close()
        return why

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass

    @property
    def signal(self) -> int | None:
        rc = self.proc.returncode
        return -rc if rc is not None and rc < 0 else None


class _Pool:
    def __init__(self, size: int):
        self._slots = threading.BoundedSemaphore(size)
        self._idle: list[_Child] = []
        self._lock = threading.Lock()

    def run(self, request: bytes, budget_s: float) -> tuple[dict | str, int | None]:
        deadline = time.monotonic() + budget_s  # waiting for a free child counts too
        if not self._slots.acquire(timeout=budget_s):
            return "busy", None
        try:
            with self._lock:
                child = self._idle.pop() if self._idle else None
            if child is None:
                child = _Child()
            answer = child.ask(request, deadline)
            if isinstance(answer, dict):
                with self._lock:
                    self._idle.append(child)
            return answer, child.signal
        finally:
            self._slots.release()


_pool = _Pool(POOL_SIZE)


def compile_constraint(field: str, kind: str, value, shown: str, budget_s: float = COMPILE_BUDGET_S) -> str:
    """The llguidance grammar of the constraint, compiled once in a child; a ConfigError
    naming `field` (and showing `shown`, a short form of the value) when it does not
    compile, crashes the compiler or outlasts the budget."""
    try:
        request = json.dumps({"kind": kind, "value": value}, ensure_ascii=False).encode("utf-8") + b"\n"
    except (UnicodeEncodeError, ValueError) as exc:
        raise ConfigError(field, shown, f"does not compile: {exc}") from None
    answer, signal = _pool.run(request, budget_s)
    if answer == "timeout":
        raise ConfigError(field, shown, f"took longer than the {budget_s:g} s compile budget; simplify it")
    if answer == "busy":
        raise ConfigError(field, shown, f"could not start compiling within the {budget_s:g} s compile budget "
                                        "(other constraints are compiling); retry")
    if answer == "died":
        how = f" (signal {signal}: most likely a stack overflow on deep nesting)" if signal else ""
        raise ConfigError(field, shown, f"crashed the grammar compiler{how}; make it shallower or smaller")
    if "error" in answer:
        raise ConfigError(field, shown, f"does not compile: {answer['error']}")
    return answer["grammar"]


def _compile_into(answer: dict, kind: str, value) -> None:
    answer.update(compile_here(kind, value))


def _serve() -> None:
    """The child's loop. Each compile runs on a thread with a small stack (see above)."""
    threading.stack_size(CHILD_STACK_BYTES)
    try:
        os.nice(CHILD_NICENESS)  # a compile yields the CPU to the workers' step loops
    except OSError:
        pass
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        request = json.loads(line)
        answer: dict = {}
        worker = threading.Thread(target=_compile_into, args=(answer, request["kind"], request["value"]))
        worker.start()
        worker.join()
        out.write(json.dumps(answer, ensure_ascii=False).encode("utf-8") + b"\n")
        out.flush()


if __name__ == "__main__":
    _serve()
