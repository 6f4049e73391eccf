"""One module per `minivllm bench` driver: its flags, its settings and how it runs (see
minivllm/bench/driver.py); the list lives in minivllm/bench/registry.py."""
