"""Unit tier: pure logic and tools, no sidecar part running (plan, matching, leases, validation,
the CUDA call layer on FakeCudaDriver, the shim's pieces with vLLM imported). `make test-unit`."""
