"""Node tier: sidecar parts running inside the test process (whole nodes on the fake transport and
FakeCudaDriver, the data plane, the NIXL owner thread, an in-process server). No sidecar daemon is
started. `make test-node`."""
