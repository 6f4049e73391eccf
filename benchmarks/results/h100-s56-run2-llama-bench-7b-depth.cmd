/root/i41/llama/llama.cpp/build/bin/llama-bench -m /root/i41/cache/models/synthetic-qwen2.5-7b-q4_k_m/qwen2.5-7b-q4_k_m-synthetic-v1.gguf -ngl 99 -p 0 -n 128 -d 0,512,4096 -r 3 -o json
