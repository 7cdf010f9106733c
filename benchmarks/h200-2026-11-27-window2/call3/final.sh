#!/usr/bin/env bash
# the session's last device call: decode with CUDA graphs, the gpu step, the fixed generation test, 1k aot vs JIT
out=$1; cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 FLASH_ATTN_AOT_LIBRARY=$PWD/gpu-carry/lib/libflash_attn_aot.so FLASH_ATTN_AOT_DIR=$PWD/gpu-carry/aot FLASH_ATTN_STRICT_BACKEND=1
s=/tmp/final; mkdir -p $s/a $s/b
t0=$(date +%s)
timeout -s INT -k 3 50 python -m flash_attn bench gpu --out $s/a --headdims 64 --dtypes bf16 --seqlens 1024 --impls 'flash_attn[aot],sdpa[flash]' --decode-batches 1,16,64 --decode-cachelens 4096,131072 --no-plot > $s/a/bench.log 2>&1; echo "A rc=$? at $(( $(date +%s) - t0 ))s"
tar -czf $out/a.tgz -C $s a
timeout -s INT -k 3 105 python -m pytest -q -rfEs -p no:cacheprovider -n 12 --flash-device cuda --flash-no-skip --flash-backend aot -m "gpu and not full_matrix" --ignore tests/test_cuda_graphs.py --ignore tests/test_two_devices.py tests > $s/gpu-step.log 2>&1; echo "gpu rc=$? at $(( $(date +%s) - t0 ))s"; tail -3 $s/gpu-step.log
timeout -s INT -k 3 25 python -m pytest -q -rfEs -p no:cacheprovider --flash-device cuda --flash-no-skip tests/test_generation.py -k "cuda_graph or larger_batch" > $s/generation.log 2>&1; echo "gen rc=$? at $(( $(date +%s) - t0 ))s"; tail -3 $s/generation.log
tar -czf $out/check.tgz -C $s gpu-step.log generation.log
timeout -s INT -k 3 55 python -m flash_attn bench gpu --out $s/b --headdims 64,128 --dtypes bf16 --seqlens 1024 --impls 'flash_attn[aot],flash_attn[triton],sdpa[flash]' --no-decode --no-plot > $s/b/bench.log 2>&1; echo "B rc=$? at $(( $(date +%s) - t0 ))s"
tar -czf $out/b.tgz -C $s b
