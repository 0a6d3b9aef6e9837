#!/usr/bin/env bash
# Fills .whl/ (ignored by git) with what bench/gpu_run.sh needs on a GPU machine whose Python 3.12
# has PyTorch with CUDA 13, grpcio and protobuf but reaches no registry: the wheels below, and
# nixl-cu13's wheel as a zip cut to what the sidecar loads (the UCX plugin and UCX's CUDA and
# shared-memory modules; not nixl_ep's PyTorch extensions, the other plugins or InfiniBand), which
# takes it from 56 MiB to 14 MiB so that it fits the 64 MiB a device call carries (24 MiB in all).
# Everything gpu_run.sh runs (the GPU tests, bench.gpu_proof, the GPU fault cells) needs only these
# and what such images have: PyTorch, numpy, pytest with pytest-timeout, hypothesis and psutil
# (tests/conftest.py, tests/support/fuzzing.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$PWD/.venv/bin/python}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
fetch() {
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$1" "${@:2}"
}
fetch .whl nixl==1.5.1 grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 \
    grpcio-reflection==1.85.1 structlog==26.1.0 pydantic==2.14.4 pydantic_core==2.50.5 \
    pydantic-settings==2.16.3 python-dotenv==1.2.4 blake3==1.0.11 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing_extensions==4.16.0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fetch "$work" nixl-cu13==1.5.1
mkdir "$work/tree"
"$PY" -m zipfile -e "$work"/nixl_cu13-*.whl "$work/tree"
(
    cd "$work/tree"
    rm -rf nixl_ep_cu13 nixl_cu13.scripts
    for plugins in nixl_cu13.libs/nixl .nixl_cu13.mesonpy.libs/plugins; do
        find "$plugins" -name '*.so' ! -name libplugin_UCX.so -delete
    done
    rm -f .nixl_cu13.mesonpy.libs/libobj_utils.so nixl_cu13.libs/ucx/libucx_perftest* nixl_cu13.libs/ucx/libuct_ib*
    rm -f nixl_cu13.libs/{libaws,libazure,libs2n,libxml2,libgusli,libfabric,libmlx5,libibverbs,libnl-,libcurl,libaio}*
    "$PY" -c 'import shutil; shutil.make_archive("../nixl_cu13_stripped", "zip", ".")'
)
mv "$work/nixl_cu13_stripped.zip" .whl/
du -sh .whl
