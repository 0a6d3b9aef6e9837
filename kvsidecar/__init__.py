"""Generated protobuf and gRPC stubs of the public ``kvsidecar.v1`` contract.

This package has no side effects on import (no NIXL, no logging setup): both the daemon
(``sidecar``) and the in-engine shim (``engine_shim``) import it. Regenerate with ``make proto``.
"""
