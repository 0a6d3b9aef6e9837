"""The engine side of kvsidecar: code that runs inside (or stands in for) an inference engine.

It imports nothing of the daemon (``sidecar``), only the generated ``kvsidecar.v1`` stubs.
- ``client``: the synchronous EngineService client and event watcher;
- ``memory``: exporting KV memory through POSIX shared memory;
- ``simulated``: a plain-Python engine used by the demo, the benchmark and the tests;
- ``vllm``: the vLLM connector package (``SidecarConnector``, loaded by vLLM through
  ``kv_connector_module_path``); ``vllm_connector`` is its alias for existing settings.
"""
