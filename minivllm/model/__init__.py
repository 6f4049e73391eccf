"""The decoder model: configuration from GGUF metadata, the loader, the forward.

How the package works (the design notes that ARCHITECTURE.md used to carry):

`ModelConfig.from_gguf` validates the architecture and hyper-parameters. The loader
copies raw GGUF bytes to the device and keeps projection and embedding weights as
blocks; only norms, biases and RoPE factors are dequantized (to f32).
`DecoderModel.using(options)` runs forwards under other kernel options (a context: the
model's own defaults never change; `forward_batch(..., options=)` does the same per
call); `forward(..., hidden_states=[])` records the residual stream after the embedding and every layer
`DecoderModel.forward(ids, start_pos, cache)` is shared by Llama and Qwen2
"""
