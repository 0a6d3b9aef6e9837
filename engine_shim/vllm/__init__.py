"""The vLLM connector shim as a package; ``connector.SidecarConnector`` is what vLLM loads.

See ``connector``'s docstring for the roles and threads. Importing this package imports nothing;
every submodule imports vLLM (and ``vllm`` below always means the real vLLM package).

Every module logs as ``vllm.kvsidecar.<module>``: vLLM configures its handlers and level on the
``vllm`` logger only, so a logger outside it would drop its info lines from the engine's log.
"""
