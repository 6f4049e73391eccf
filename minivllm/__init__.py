"""minivllm: a Jupyter-first LLM inference workbench over GGUF models.

    from minivllm import LLM, SamplingParams
    llm = LLM(model="smollm2-135m", device="cpu", dtype="float32")
    print(llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=32))[0].text)
"""

from minivllm.sampling.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # `LLM` pulls in torch, the model and the tokenizer; importing it lazily keeps
    # `minivllm models list` and `import minivllm` fast.
    if name == "LLM":
        from minivllm.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'minivllm' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "__version__"]
