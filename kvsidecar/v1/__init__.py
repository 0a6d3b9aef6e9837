"""kvsidecar.v1 messages and services, generated from ``proto/kvsidecar/v1/*.proto``."""
