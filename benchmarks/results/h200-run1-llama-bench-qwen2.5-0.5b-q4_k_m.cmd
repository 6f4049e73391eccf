/root/llama/llama.cpp/build/bin/llama-bench -m /root/mcache/models/synthetic-qwen2.5-0.5b-q4_k_m/qwen2.5-0.5b-q4_k_m-synthetic-v1.gguf -ngl 99 -p 512 -n 128 -r 5 -o json
