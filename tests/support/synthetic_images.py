"""An ahead-of-time manifest synthesised from the specialisation set, without compiling anything.

Entries carry what the ``aot`` backend reads to plan, pack and launch (key, kernel name, the
signature per the kernels' declarations, warps) and point at image files that do not exist: tests
that stub the op library's registration and launch run the real backend against it, also where
Triton is not installed (no import of Triton here).
"""

from __future__ import annotations

import types

from flash_attn.aot import library as op_library, manifest as aot_manifest, specializations as S


def synthetic_manifest(capability=(9, 0), arch: str = "sm_90a") -> aot_manifest.Manifest:
    entries = []
    for spec in S.specs_for_capability(capability):
        sig, attrs = S.signature(spec)
        entries.append({"arch": arch, "key": spec.key, "kernel": spec.kernel, "name": spec.kernel,
                        "image": f"images/{arch}/{spec.key}.cubin", "constexprs": spec.constexprs,
                        "signature": op_library.triton_signature(types.SimpleNamespace(signature=sig, attrs=attrs)),
                        "num_warps": spec.num_warps, "shared": 0})
    return aot_manifest.Manifest("/nonexistent", {"archs": [arch], "kernels": entries})
