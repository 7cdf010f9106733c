#!/usr/bin/env bash
# Builds flash-attn into $PREFIX on Linux and macOS (build.bat is the Windows twin, CPU only): for
# CUDA variants the op library (CMake through scikit-build-core) and the ahead-of-time kernels; the
# CPU variant compiles nothing (CMakeLists.txt). Used by rattler-build and, with PREFIX/SP_DIR/PYTHON
# set by hand, by tests/packaging/test_packaging.py.
#
# Portable on purpose: macOS runs this with its /bin/bash 3.2 and BSD tools, so no `sed -i` (BSD sed
# wants a suffix argument) and no bare "$@" under `set -u` (bash < 4.4 calls an empty "$@" unbound).
set -euxo pipefail

export MAX_JOBS="${MAX_JOBS:-${CPU_COUNT:-2}}"

# pixi-build copies only the files the build reads (recipe.yaml's `source`), not README.md, which
# pyproject.toml names as the wheel's long description: a one-line stand-in then.
if [[ ! -f README.md ]]; then
    echo "# flash-attn" > README.md
fi
export CMAKE_BUILD_PARALLEL_LEVEL="${MAX_JOBS}"

if [[ "${cuda_compiler_version:-None}" == "None" ]]; then
    export FLASH_ATTN_CPU_ONLY=1
    export FLASH_ATTN_ENABLE_CUDA=OFF
else
    export FLASH_ATTN_ENABLE_CUDA=ON
    # conda-forge's libtorch (host): headers in $PREFIX/include/torch, libtorch_cpu.so in $PREFIX/lib
    # (its pytorch ships no site-packages/torch/include).
    export FLASH_ATTN_TORCH_DIR="${FLASH_ATTN_TORCH_DIR:-${PREFIX}}"
    export CUDA_HOME="${CUDA_HOME:-${BUILD_PREFIX}}"
    # FLASH_ATTN_CUDA_ARCHS: the recipe's `cuda_archs` (or the caller's), less the family targets
    # this toolkit's ptxas cannot assemble (Thor's sm_110f needs CUDA 13.0): flash_attn/kernel_build.
    # Triton must use the toolchain's ptxas (pinned by cuda_compiler_version), not the one in its wheel.
    export TRITON_PTXAS_PATH="${TRITON_PTXAS_PATH:-${BUILD_PREFIX}/bin/ptxas}"
    export TRITON_PTXAS_BLACKWELL_PATH="${TRITON_PTXAS_BLACKWELL_PATH:-${TRITON_PTXAS_PATH}}"
    # No source file names (absolute build paths) in the PTX/cubin line tables of a release build.
    export TRITON_DISABLE_LINE_INFO="${TRITON_DISABLE_LINE_INFO:-1}"
    # The kernel build runs with the build machine's Python, which has triton. Its versioned name:
    # when cross-compiling, cross-python replaces bin/python with a shim to its crossenv.
    KERNEL_PYTHON="${KERNEL_PYTHON:-${BUILD_PREFIX}/bin/python${PYTHON_MIN:-3}}"
    set -- -Ccmake.define.Python_EXECUTABLE="${KERNEL_PYTHON}"
fi

# ${1+"$@"}: the extra arguments set above, or nothing (see the note at the top).
"${PYTHON}" -m pip install . -vv --no-deps --no-build-isolation --ignore-installed \
    --prefix="${PREFIX}" -Cbuild-dir="${SRC_DIR:-.}/build/conda-${cuda_compiler_version:-None}" ${1+"$@"}
# pip records the temporary source folder here: an absolute build path, and of no use in a conda package.
find "${PREFIX}" -path '*/flash_attn-*.dist-info/direct_url.json' -delete
# The kernel build report (CUDA variants) names the tools it used; keep their names, not the build
# machine's paths. sed to a temporary file and mv: the same on GNU and BSD sed.
find "${PREFIX}" -path '*/flash_attn/_aot/build-report.json' -print0 | while IFS= read -r -d '' report; do
    sed "s#${BUILD_PREFIX:-/nonexistent}#\$BUILD_PREFIX#g" "${report}" > "${report}.tmp"
    mv "${report}.tmp" "${report}"
done
