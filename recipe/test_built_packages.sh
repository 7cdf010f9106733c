#!/usr/bin/env bash
# Tests every flash-attn package `pixi run build` wrote into OUTPUT/<subdir> and OUTPUT/noarch
# (default ./output) with `rattler-build test`, as far as this machine can (docs/install-and-build.md):
#
# - the CPU build (noarch): every test step;
# - a CUDA build whose CUDA major this machine's driver supports: every test step, the GPU tests on
#   the GPU;
# - a CUDA build without such a driver (no driver at all, or a CUDA 12 driver and the CUDA 13
#   build): its test environment cannot be installed as it is (the package requires `__cuda >=N`
#   and a CUDA PyTorch), so it is tested with CONDA_OVERRIDE_CUDA=N.0: imports, doctor, the CPU
#   tests, the op library's checks; its GPU step finds no device and says "GPU tests not run".
#   This script says so too, per package.
#
# `pixi run build` exports CONDA_OVERRIDE_CUDA for the build's solves (pixi.toml): every other test
# here runs without it, with this machine's own driver.
#
# Exits non-zero if any package's tests fail. A package is never moved to output/broken here:
# `rattler-build build --test skip` builds, this script tests.
set -euo pipefail

output="${1:-output}"
case "$(uname -s)-$(uname -m)" in
    Linux-x86_64) subdir=linux-64 ;;
    Linux-aarch64) subdir=linux-aarch64 ;;
    Darwin-arm64) subdir=osx-arm64 ;;
    Darwin-x86_64) subdir=osx-64 ;;
    *) echo "unsupported machine $(uname -sm)" >&2; exit 2 ;;
esac

# The CUDA major version this machine's driver supports (0: none), from nvidia-smi's header.
driver_cuda_major=0
if command -v nvidia-smi > /dev/null 2>&1; then
    version=$(nvidia-smi 2> /dev/null | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' | head -n 1)
    driver_cuda_major="${version:-0}"
fi

shopt -s nullglob
packages=("${output}/${subdir}"/flash-attn-*.conda "${output}/noarch"/flash-attn-*.conda)
if [[ ${#packages[@]} -eq 0 ]]; then
    echo "no flash-attn package in ${output}/${subdir} or ${output}/noarch" >&2
    exit 1
fi

failed=0
for package in "${packages[@]}"; do
    if [[ "$(basename "${package}")" == flash-attn-fa3-* ]]; then
        # FlashAttention-3's interface (noarch): its test environment needs flash-attn of the same
        # version, which is in OUTPUT, not on conda-forge (docs/conda-forge.md, not yet).
        echo "== ${package}: not tested here (its test needs this flash-attn from ${output})"
        continue
    fi
    build=$(basename "${package}" .conda)
    build="${build##*-}"                      # e.g. cuda129_h1234567_200, cpu_h7654321_0
    kind="${build%%_*}"
    if [[ "${kind}" == cuda* ]]; then
        major="${kind#cuda}"
        major="${major%?}"                    # cuda129 -> 12, cuda130 -> 13
        if (( driver_cuda_major >= major )); then
            echo "== ${package}: all tests (a driver for CUDA ${driver_cuda_major})"
            env -u CONDA_OVERRIDE_CUDA rattler-build test --package-file "${package}" || failed=1
        else
            echo "== ${package}: no driver for CUDA ${major} here: tested with CONDA_OVERRIDE_CUDA=${major}.0, GPU tests not run"
            CONDA_OVERRIDE_CUDA="${major}.0" rattler-build test --package-file "${package}" || failed=1
        fi
    else
        echo "== ${package}: all tests"
        env -u CONDA_OVERRIDE_CUDA rattler-build test --package-file "${package}" || failed=1
    fi
done
exit "${failed}"
