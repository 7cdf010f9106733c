"""``bench overhead``'s three calls on the code before the launch planner (commit 09b8830), stubbed
the same way: CPU tensors, an sm_90a manifest synthesised from that code's specialisation set,
kernel registration and launch replaced by no-ops; CPU time per call.

    git worktree add /tmp/old 09b8830
    OMP_NUM_THREADS=1 python benchmarks/overhead_before_planner.py     # prints the table rows
"""
import sys, time, types, statistics
sys.meta_path[:] = [f for f in sys.meta_path if 'ScikitBuild' not in type(f).__name__]
sys.path.insert(0, '/tmp/old')
import torch
torch.set_num_threads(1)
from flash_attn import _aot_library, dispatch
from flash_attn.backends import aot
from flash_attn.kernels import specializations as S
entries = []
for spec in S.specs_for_capability((9, 0)):
    sig, attrs = S.signature(spec)
    entries.append({"arch": "sm_90a", "key": spec.key, "kernel": spec.kernel, "name": spec.kernel,
                    "image": f"images/sm_90a/{spec.key}.cubin", "constexprs": spec.constexprs,
                    "signature": _aot_library.triton_signature(types.SimpleNamespace(signature=sig, attrs=attrs)),
                    "num_warps": spec.num_warps, "shared": 0})
m = aot.Manifest("/nonexistent", {"archs": ["sm_90a"], "kernels": entries})
aot.manifest = lambda: (m, "")
torch.cuda.get_device_capability = lambda device=None: (9, 0)
from flash_attn.kernels import decode_launch
decode_launch._cuda_sm_count = lambda index: 132
import flash_attn.kernels.decode_launch as dl
dl.num_sms = lambda device, interpret: 132
_aot_library.register_kernel = lambda image, entry: 0
launches = [0]
def no_launch(*a): launches[0] += 1
_aot_library.launch = no_launch
dispatch.select_backend = lambda device: aot
from flash_attn import custom_ops as _ops; _ops.select_backend = lambda device: aot

from flash_attn import flash_attn_func, flash_attn_with_kvcache
g = torch.Generator().manual_seed(0)
rnd = lambda *shape: torch.randn(*shape, generator=g).to(torch.bfloat16)
q, k, v = rnd(1, 128, 16, 128), rnd(1, 128, 16, 128), rnd(1, 128, 16, 128)
qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
dout = rnd(1, 128, 16, 128)
kc, vc = rnd(8, 4096, 8, 128), rnd(8, 4096, 8, 128)
sq, sk, sv = rnd(8, 1, 32, 128), rnd(8, 1, 8, 128), rnd(8, 1, 8, 128)
lens = torch.full((8,), 2000, dtype=torch.int32)
def training():
    for t in (qg, kg, vg): t.grad = None
    flash_attn_func(qg, kg, vg, causal=True).backward(dout)
calls = {"forward": lambda: flash_attn_func(q, k, v, causal=True), "forward+backward": training,
         "decode step": lambda: flash_attn_with_kvcache(sq, kc, vc, sk, sv, cache_seqlens=lens, causal=True)}
for name, fn in calls.items():
    fn(); b = launches[0]; fn(); n = launches[0] - b
    for _ in range(20): fn()
    times = []
    for _ in range(5):
        s = time.process_time()
        for _ in range(200): fn()
        times.append((time.process_time() - s) / 200 * 1e6)
    print(f"| {name} | {statistics.median(times):.1f} | {min(times):.1f} | {max(times):.1f} | {n} |")
