"""Alias of ``engine_shim.vllm.connector``, kept so that existing vLLM settings
``"kv_connector_module_path": "engine_shim.vllm_connector"`` keep working (vLLM imports the module
by that path and takes ``SidecarConnector`` from it). New settings may name either path."""

from engine_shim.vllm.connector import ShimConfig, SidecarConnector, SidecarConnectorMetadata, compat_factors

__all__ = ["ShimConfig", "SidecarConnector", "SidecarConnectorMetadata", "compat_factors"]
