"""The CUDA IPC handle of a VRAM ``MemoryExport`` (``cuda_ipc_handle``): its size, which the engine
shim checks when it takes the handle out of PyTorch's and the sidecar checks when it opens one.
``cudaIpcMemHandle_t`` and the driver's ``CUipcMemHandle`` are the same 64 bytes."""

CUDA_IPC_HANDLE_BYTES = 64
