"""What the kernels rely on, as AMD GPUs compile it (no AMD GPU is available: read from the code
Triton makes for each AMD family, next to the code it makes for an NVIDIA GPU).

* Dropout's counter-based RNG (flash_attn/kernels/dropout_rng.py): the keep decision must be the
  same bits on every GPU, so that forward, backward and the PyTorch reference agree. Triton lowers
  Philox to LLVM integer arithmetic (wrapping 32-bit multiplies, xors and adds, defined the same on
  every target) and maps the word to [0, 1) with one int-to-float conversion and one multiply, then
  compares: the same operations, in the same number, for AMD as for NVIDIA. What this cannot show:
  the GPU executing them (LLVM's integer semantics are what make the bits equal).
* The fused backward's dQ: fp32 atomic adds, relaxed, at device (agent) scope. CDNA3/4 and RDNA4
  have a float atomic add instruction; RDNA3 has none and gets compare-and-swap loops (correct,
  slow): its table runs the split backward, which has no atomics.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from flash_attn.kernel_build import amd_report
from flash_attn.planning import configs, families

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flash_attn.kernels.dropout_rng import dropout_keep  # noqa: E402

AMD = families.of_vendor("amd")


@triton.jit
def _keep_kernel(Seed, Out, p, batch, head):
    row = tl.program_id(0)
    col = tl.program_id(1)
    keep = dropout_keep(tl.load(Seed), batch, head, row, col, p)
    tl.store(Out + row * 4096 + col, keep.to(tl.int8))


def _compile(kernel, signature, family):
    return triton.compile(ASTSource(kernel, signature), target=GPUTarget(*families.triton_target(family)))


_RNG_SIGNATURE = {"Seed": "*i64", "Out": "*i8", "p": "fp32", "batch": "i32", "head": "i32"}
# the operations of Philox's rounds and of the word's mapping to [0, 1) and the comparison
_ARITHMETIC = ("mul", "xor", "add", "sitofp", "uitofp", "fmul", "fadd", "fdiv", "fcmp", "fptrunc", "fpext")


def _arithmetic(llir: str) -> Counter:
    body = llir[llir.index("define"):]
    ops = re.findall(r"=\s+(?:(?:nuw|nsw|exact|disjoint|nnan|ninf|contract|afn|reassoc|fast)\s+)*([a-z]+)\s", body)
    return Counter(op for op in ops if op in _ARITHMETIC)


def _float_lines(llir: str) -> list[str]:
    body = llir[llir.index("define"):]
    lines = [re.sub(r"%\w+", "%", line.split(", !dbg")[0].strip()) for line in body.splitlines()
             if re.search(r"\b(sitofp|uitofp|fmul|fcmp)\b", line)]
    return lines


@pytest.mark.parametrize("family", AMD)
def test_dropout_rng_is_the_same_arithmetic_on_amd_as_on_nvidia(family):
    nvidia = _compile(_keep_kernel, _RNG_SIGNATURE, "sm80").asm["llir"]
    amd = _compile(_keep_kernel, _RNG_SIGNATURE, family).asm["llir"]
    assert _arithmetic(amd) == _arithmetic(nvidia), (_arithmetic(amd), _arithmetic(nvidia))
    assert _arithmetic(amd)["mul"] >= 20  # Philox's ten rounds of two multiplies are all there
    # one conversion, one multiply by 2**-31 (the same constant), one >= comparison
    assert _float_lines(amd) == _float_lines(nvidia) and len(_float_lines(amd)) == 3


@pytest.mark.parametrize("family", AMD)
def test_fp32_atomic_adds_are_relaxed_device_scope_and_native_where_the_table_fuses(family):
    """The fused backward itself (head dim 64, 16 x 64 tiles), compiled for each family: its dQ
    adds are LLVM ``atomicrmw fadd``, monotonic (relaxed) at agent (device) scope; the assembly
    has the float add instruction, or compare-and-swap loops where the target has none."""
    from flash_attn.aot import specializations as S
    from flash_attn.kernel_build import amd

    config = configs.Config(16, 64, 4, 1)
    compiled = amd.compile_spec(S.attention_spec("attn_bwd_kernel", "bf16", 64, config, family), config, family)
    llir, amdgcn = compiled.asm["llir"], compiled.asm["amdgcn"]
    adds = [line for line in llir.splitlines() if "atomicrmw fadd" in line]
    assert adds and all('syncscope("agent")' in line and "monotonic" in line for line in adds), adds
    how = amd_report.fp32_atomics(amdgcn)
    assert how == ("cas" if family == "rdna3" else "native"), how
    if how == "cas":  # a compare-and-swap loop per element: the split backward runs, no fused one
        assert all(configs.fused_backward(d, family) is None for d in configs.HEADDIM_BUCKETS
                   if configs.refusal(d, family) is None)
