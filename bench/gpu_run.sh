#!/usr/bin/env bash
# The GPU proof in one command, on a GPU machine whose Python has PyTorch with CUDA, grpcio and
# protobuf but reaches no package registry: the other dependencies come as wheels (or zips of
# them) in .whl/ (made by bench/gpu_wheels.sh, 24 MiB), unpacked to /tmp/site. Nothing is fetched.
# bench/README.md ("The GPU path") says what this printed. Results land in $OUT (default
# bench/out). The image must have pytest and pytest-timeout (the GPU machines of this project's
# device tool do).
#
# Steps, each bounded, about 6 minutes in all (the device tool lends 15):
#   1. the GPU tests (PYTEST_SECONDS, 160): tests/daemon/test_gpu.py and every test_gpu_*.py in
#      tests/{unit,node,daemon}
#      (the other GPU suites, and the CPU-only parts of the proof and of the fault cells' harness);
#   2. bench.gpu_proof (BENCH_SECONDS, 110): on SIGTERM it stops measuring and still reports the
#      rows it has, with what UCX chose for them;
#   3. the chaos matrix's GPU fault cells (CELLS_SECONDS, 100): tests/chaos/test_gpu_faults.py.
# Exit status: non-zero if a test or a cell failed, or the proof failed (a row not verified byte
# for byte, or moved by UCX's software emulation); `GPU_PROOF_ARGS=--strict` also fails on a
# missed target.
set -u
OUT=${OUT:-bench/out}
mkdir -p "$OUT" /tmp/site
[ -d .whl ] || { echo "no .whl/ here: make it with bench/gpu_wheels.sh and carry it" >&2; exit 2; }
for wheel in .whl/*; do python3 -m zipfile -e "$wheel" /tmp/site; done
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
# UCX's CUDA memory hooks need libcudart; on such images it sits in a pip package, not on the
# loader's path.
for lib in /usr/local/cuda/lib64 $(python3 -c 'import glob, site; print(" ".join(sorted({p.rsplit("/", 1)[0] for s in site.getsitepackages() for p in glob.glob(s + "/nvidia/*/lib/libcudart.so*")})))'); do
    LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
done
export LD_LIBRARY_PATH
nvidia-smi -L
nvidia-smi topo -m 2>/dev/null | head -20  # NVLink or PCIe between GPUs: what cuda_ipc's READ defaults follow
python3 -c 'import torch, grpc, nixl_cu13; print("torch", torch.__version__, "cuda", torch.version.cuda, "grpc", grpc.__version__)'
status=0
tests=(tests/daemon/test_gpu.py)
for extra in tests/unit/test_gpu_*.py tests/node/test_gpu_*.py tests/daemon/test_gpu_*.py; do
    [ -e "$extra" ] && tests+=("$extra")
done
timeout -k 15 "${PYTEST_SECONDS:-160}" python3 -m pytest "${tests[@]}" -v -p no:cacheprovider --timeout 120 2>&1 | tee "$OUT/pytest-gpu.log"
status=$((status | PIPESTATUS[0]))
# shellcheck disable=SC2086  # GPU_PROOF_ARGS is a list of arguments
timeout -k 20 "${BENCH_SECONDS:-110}" python3 -m bench.gpu_proof --json "$OUT/gpu-proof.json" ${GPU_PROOF_ARGS:-} "$@" 2>&1 | tee "$OUT/gpu-proof.log"
status=$((status | PIPESTATUS[0]))
KVSIDECAR_CHAOS_LOGS="$OUT/chaos-logs" timeout -k 15 "${CELLS_SECONDS:-100}" python3 -m pytest tests/chaos/test_gpu_faults.py -v -s -p no:cacheprovider --timeout 60 2>&1 | tee "$OUT/pytest-gpu-faults.log"
status=$((status | PIPESTATUS[0]))
# The tables UCX printed (the proof also copies each sidecar's log to $OUT): what was chosen, where.
grep -h -E "\| (remote memory|[0-9]+\.\.)" "$OUT"/sidecar-*.log "$OUT"/ucx-proto-bench.log 2>/dev/null \
    | sed -E 's/^\[[^]]*\] \[[^]]*\] *//' | sort | uniq -c | sort -rn | head -40 > "$OUT/ucx-proto-summary.txt"
exit $status
