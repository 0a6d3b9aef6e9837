"""vLLM tier: real CPU vLLM instances with the connector (every module carries the `vllm`
marker; they pin both cores). `make test-vllm`."""
