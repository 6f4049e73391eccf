"""Outside engines as `compare` sides: transformers (the float32 reference) and llama.cpp.

Both load the same GGUF file minivllm loads and generate greedily one token at a time
through their own KV cache, recording the top-k float32 logits of every step, so their
records line up with an engine side's position by position.

transformers: `AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=float32)`,
as the reference tests load it (tests/integration/model/test_forward_reference.py): it
dequantizes with the gguf package's numpy code and runs its own Llama/Qwen2 modules, so
it shares no code with minivllm's reader, kernels or attention. Its hidden states come
from `output_hidden_states=True` over the replayed sequence. How its tuple lines up
with the engine's record (`DecoderModel.forward_batch(hidden_states=[])`):

    engine:        [embedding, after layer 0, ..., after layer N-1]      (all before the final norm)
    transformers:  [embedding, after layer 0, ..., norm(after layer N-1)]

transformers replaces the last entry with `last_hidden_state`, which has the final RMSNorm
applied. A forward hook on the last decoder layer captures its pre-norm output; the
replay checks that the model's own norm of that capture is exactly the entry
transformers returned (so the capture is the quantity it normalised) and puts it in
the last slot. If that check fails (a transformers version that records differently),
the last entry is marked not comparable rather than compared against a normed vector.

llama.cpp (llama-cpp-python, optional): `Llama(..., logits_all=True)` on the CPU, greedy
per token from `scores`; it exposes no hidden states, so a comparison with it has no
layer table (the report's layer_note says so).
"""

from __future__ import annotations

from pathlib import Path

import torch

from minivllm.debug.hidden_state_diff import ReplayChunk
from minivllm.devices import describe_device
from minivllm.errors import EngineNotInstalledError, MinivllmError

REPLAY_CHUNK = 512  # rows per transformers forward in the hidden-state replay (bounds its memory)


def load_transformers_model(path: Path, device: torch.device):
    """transformers' float32 model from the GGUF file at `path`, on `device`, in eval mode."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise EngineNotInstalledError(
            "transformers",
            "transformers",
            f"the transformers package cannot be imported ({exc}); pip install transformers",
        ) from None
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 local_files_only=True)
    return model.to(device).eval()


def _top(logits: torch.Tensor, k: int) -> tuple[int, tuple[list[int], list[float]]]:
    """Greedy choice (torch.argmax: the lowest id among equal maxima, as the engine's sampler) and top-k."""
    logits = logits.float()
    values, ids = torch.topk(logits, k)
    return int(torch.argmax(logits)), (ids.tolist(), values.tolist())


class TransformersSide:
    engine = "transformers"

    def __init__(self, side: str, path: Path, device: torch.device, stop_ids: frozenset[int]):
        self.side, self.device, self.stop_ids = side, device, stop_ids
        self.model = load_transformers_model(path, device)
        import transformers

        self.version = transformers.__version__
        self.n_layers = int(self.model.config.num_hidden_layers)
        # The KV cache argument is `past_key_values` in older transformers and `cache` in newer
        # ones (5.24 warns that the old name goes in 5.40).
        import inspect

        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self._last_not_comparable: str | None = None

    def _forward(self, ids: list[list[int]], cache, **kwargs):
        """One forward through the cache; returns (output, the cache to pass next)."""
        out = self.model(input_ids=torch.tensor(ids, device=self.device), use_cache=True,
                         **{self._cache_kw: cache}, **kwargs)
        new_cache = out.get("cache")
        return out, new_cache if new_cache is not None else out.get("past_key_values")

    def settings(self) -> dict:
        return {"engine": "transformers", "device": describe_device(self.device), "dtype": "f32",
                "weights": "own (transformers' GGUF dequantization, dense float32)", "transformers": self.version,
                "kv_cache": f"transformers' own, passed as {self._cache_kw}"}

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_tokens: int, k: int,
               ) -> tuple[list[int], list[tuple[list[int], list[float]]]]:
        """The prompt in one forward, then one token per forward through its KV cache (`past_key_values`);
        stops at the engine's stop tokens (the same GGUF's end-of-generation ids)."""
        out, cache = self._forward([list(prompt_ids)], None)
        tokens, tops = [], []
        while True:
            token, top = _top(out.logits[0, -1], k)
            tokens.append(token)
            tops.append(top)
            if token in self.stop_ids or len(tokens) >= max_tokens:
                return tokens, tops
            out, cache = self._forward([[token]], cache)

    def not_comparable(self) -> dict[int, str]:
        """Entries of the hidden-state record that are not the engine's quantity (after a replay)."""
        return {} if self._last_not_comparable is None else {self.n_layers: self._last_not_comparable}

    @torch.inference_mode()
    def replay(self, token_ids: list[int], n_prompt: int):
        """The residual stream over `token_ids` in chunks of REPLAY_CHUNK rows (the cache
        carries the earlier chunks), as (n_layers + 1, rows, d_model) float32."""
        base = getattr(self.model, "model", None)
        layers, norm = getattr(base, "layers", None), getattr(base, "norm", None)
        captured: list[torch.Tensor] = []
        handle = None
        if layers is not None and norm is not None and len(layers) == self.n_layers:
            handle = layers[-1].register_forward_hook(
                lambda module, args, output: captured.append(output[0] if isinstance(output, tuple) else output))
        try:
            cache = None
            for start in range(0, len(token_ids), REPLAY_CHUNK):
                captured.clear()
                out, cache = self._forward([token_ids[start:start + REPLAY_CHUNK]], cache, output_hidden_states=True)
                hidden = list(out.hidden_states)
                if len(hidden) != self.n_layers + 1:
                    raise MinivllmError(f"side {self.side}: transformers returned {len(hidden)} hidden states for a "
                                        f"{self.n_layers}-layer model (expected the embedding and one per layer)")
                hidden[-1] = self._pre_norm_last(hidden[-1], captured, norm)
                yield ReplayChunk(start, torch.stack([h[0].float() for h in hidden]), out.logits[0, -1].float())
        finally:
            if handle is not None:
                handle.remove()

    def _pre_norm_last(self, last: torch.Tensor, captured: list[torch.Tensor], norm) -> torch.Tensor:
        if len(captured) == 1 and captured[0].shape == last.shape:
            pre = captured[0]
            if torch.equal(norm(pre), last):
                return pre  # transformers' entry was the normed capture: the capture is the engine's quantity
            if torch.equal(pre, last):
                return pre  # this version already returns the pre-norm output
        self._last_not_comparable = (
            f"side {self.side}: transformers' last hidden state has the final RMSNorm applied and its pre-norm value "
            f"could not be captured from the last decoder layer, so 'layer {self.n_layers - 1}' compares different "
            f"quantities and is left out")
        return torch.full_like(last, float("nan"))


class LlamaCppSide:
    engine = "llama.cpp"
    device = torch.device("cpu")

    def __init__(self, side: str, path: Path, stop_ids: frozenset[int], n_ctx: int):
        from minivllm.bench.decode import load_llama_cpp

        module, why = load_llama_cpp()
        if module is None:
            raise EngineNotInstalledError(side, "llama.cpp", f"llama-cpp-python is {why}")
        self.side, self.stop_ids, self.lib = side, stop_ids, module
        self.threads = torch.get_num_threads()
        self.llm = module.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, n_gpu_layers=0,
                                n_threads=self.threads, n_threads_batch=self.threads, verbose=False)

    def settings(self) -> dict:
        return {"engine": "llama.cpp", "device": "cpu", "dtype": "ggml (f32 activations, quantized dot products)",
                "llama_cpp": getattr(self.lib, "__version__", "?"), "n_threads": self.threads}

    def not_comparable(self) -> dict[int, str]:
        return {}

    def replay(self, token_ids: list[int], n_prompt: int):
        return None  # llama-cpp-python gives logits only

    def greedy(self, prompt_ids: list[int], max_tokens: int, k: int,
               ) -> tuple[list[int], list[tuple[list[int], list[float]]]]:
        self.llm.reset()
        self.llm.eval(list(prompt_ids))
        tokens, tops = [], []
        while True:
            logits = torch.from_numpy(self.llm.scores[self.llm.n_tokens - 1].copy())
            token, top = _top(logits, k)
            tokens.append(token)
            tops.append(top)
            if token in self.stop_ids or len(tokens) >= max_tokens:
                return tokens, tops
            self.llm.eval([token])
