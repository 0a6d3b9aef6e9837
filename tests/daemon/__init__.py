"""Daemon tier: real sidecar processes (the `sidecars`/`engines` fixtures, SidecarProcess,
DaemonProcess) talking real gRPC and NIXL; no vLLM engine. `make test-daemon`."""
