"""GGUF file access: reading, type tables and dequantization.

How the package works (the design notes that ARCHITECTURE.md used to carry):

the file format. The reader walks the header with `struct` over an mmap (Qwen 0.5B: 0.21
s against 14 s for `gguf.GGUFReader`) and maps tensor data copy-on-write. Dequantization
is torch code that runs on the tensor's device and is bit-exact with `gguf.quants` for
F32/F16/BF16/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q2_K..Q6_K. The tokenizer is HF `tokenizers` BPE
with llama.cpp's pre-tokenizer regexes per `tokenizer.ggml.pre`, and its ids match
llama.cpp's. The streaming detokenizer works on bytes. Chat templates render in jinja2's
`ImmutableSandboxedEnvironment`; one over 256 KiB, 32768 Jinja tokens or 48 levels of
blocks and brackets is refused at load by one lexer pass (`ChatTemplateTooLarge`)
"""
