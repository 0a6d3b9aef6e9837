#!/usr/bin/env bash
# The GPU proof in one command, on a GPU machine whose Python has PyTorch with CUDA, grpcio and
# protobuf but reaches no package registry: the other dependencies come as wheels (or zips of
# them) in .whl/ (made by bench/gpu_wheels.sh), unpacked to /tmp/site. bench/README.md ("The GPU
# path") says what this printed. Results land in $OUT (default bench/out). The image must have
# pytest and pytest-timeout (the GPU machines of this project's device tool do). At most 9
# minutes: the tests are bounded at PYTEST_SECONDS (240), the benchmark at BENCH_SECONDS (300).
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
python3 -c 'import torch, grpc, nixl_cu13; print("torch", torch.__version__, "cuda", torch.version.cuda, "grpc", grpc.__version__)'
status=0
timeout "${PYTEST_SECONDS:-240}" python3 -m pytest tests/test_gpu.py -v -p no:cacheprovider --timeout 120 2>&1 | tee "$OUT/pytest-gpu.log"
status=$((status | PIPESTATUS[0]))
timeout "${BENCH_SECONDS:-300}" python3 -m bench.gpu_proof --json "$OUT/gpu-proof.json" "$@" 2>&1 | tee "$OUT/gpu-proof.log"
status=$((status | PIPESTATUS[0]))
exit $status
