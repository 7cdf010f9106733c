"""The ``aot`` backend: the kernels compiled ahead of time (``python -m flash_attn build-kernels``),
launched by the op library (``flash_attn/_C/libflash_attn_aot.so``) without Triton at run time:
nothing on this path imports Triton (the launchers name their kernels, see
:mod:`flash_attn.kernels.registry`), so it runs where Triton is not installed.

It reuses the Python launchers of :mod:`flash_attn.kernels.launch`: their single launch point
``_run`` hands every launch to :class:`AotExecutor`, which maps the call onto a shipped
specialisation (:func:`flash_attn.kernels.specializations.spec_for_call`), registers its image
once per process and calls ``torch.ops.flash_attn.aot_launch`` with the arguments packed per the
manifest's signature. ``forward_kvcache`` runs the KV-cache launcher the same way in its
*superset* mode (:mod:`flash_attn.kernels.decode_configs`). Calls without a shipped specialisation
(paged varlen forward, ``return_attn_probs``, fp32, head dims not a multiple of 8, caches that are
not 16-byte aligned, int32 overflow) run on the ``triton`` backend when it can run, else on the
reference, after a one-time warning.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Optional

import torch

from flash_attn import _aot_library, aot_images
from flash_attn.kernels import configs, registry
from flash_attn.kernels import specializations as S

__all__ = ["unavailable_reason", "forward", "backward", "forward_kvcache", "AotUnsupported"]

_NAME = "aot"
DIR_ENV = "FLASH_ATTN_AOT_DIR"
_I32 = (-(2**31), 2**31 - 1)
_ELEMENT_DTYPES = (torch.float16, torch.bfloat16)


class AotUnsupported(RuntimeError):
    """This call has no shipped specialisation (the backend falls back)."""


class Manifest:
    """``manifest.json`` of an AOT kernel folder, indexed by ``(image arch, spec key)``."""

    def __init__(self, folder: Path, data: dict):
        self.folder = Path(folder)
        self.data = data
        self.entries = {(e["arch"], e["key"]): e for e in data.get("kernels", [])}
        self.archs = sorted({e["arch"] for e in data.get("kernels", [])})
        # call shape -> answer: which specialisation a call needs is the same for every call of
        # that shape, and working it out (spec keys are hashes) costs 60-200 us, every call
        self._answers: dict = {}

    def memo(self, key: tuple, compute):
        """``compute()`` once per ``key`` for this manifest (results are plain values)."""
        try:
            return self._answers[key]
        except KeyError:
            value = self._answers[key] = compute()
            return value

    @classmethod
    def load(cls, folder: Path) -> "Manifest":
        return cls(folder, json.loads((Path(folder) / "manifest.json").read_text()))

    def image_for(self, capability: tuple[int, int]) -> aot_images.ImageChoice:
        return aot_images.select_image(capability, self.archs)

    def lookup(self, arch: str, key: str) -> Optional[dict]:
        return self.entries.get((arch, key))


def find_manifest_dir() -> Optional[Path]:
    override = os.environ.get(DIR_ENV)
    if override:
        return Path(override)
    import flash_attn  # noqa: PLC0415

    for folder in flash_attn.__path__:
        candidate = Path(folder) / "_aot"
        if (candidate / "manifest.json").is_file():
            return candidate
    return None


_manifest_cache: dict[str, object] = {}
_lock = threading.Lock()


def manifest() -> tuple[Optional[Manifest], str]:
    """The installed manifest, or ``(None, why not)``; read once per folder."""
    folder = find_manifest_dir()
    if folder is None:
        return None, ("no ahead-of-time kernels are installed (flash_attn/_aot/manifest.json is missing: "
                      "a CPU-only build, or build them with `python -m flash_attn build-kernels`)")
    key = str(folder)
    with _lock:
        if key not in _manifest_cache:
            try:
                _manifest_cache[key] = Manifest.load(folder)
            except (OSError, ValueError) as exc:
                _manifest_cache[key] = f"cannot read {folder / 'manifest.json'}: {exc}"
    value = _manifest_cache[key]
    return (value, "") if isinstance(value, Manifest) else (None, str(value))


def unavailable_reason(device: torch.device) -> Optional[str]:
    device = torch.device(device)
    if device.type != "cuda":
        return f"it launches precompiled GPU kernels and needs CUDA tensors, not {device.type}"
    if getattr(torch.version, "hip", None):
        return "its kernels are NVIDIA cubins/PTX, not ROCm"
    status = _aot_library.status()
    if not status.loaded:
        return status.reason
    m, why = manifest()
    if m is None:
        return why
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    choice = m.image_for(torch.cuda.get_device_capability(device))
    if not choice.supported:
        return choice.reason
    return None


# --- which specialisations a call needs (no GPU needed) -------------------------------------------

_FWD = ("attn_fwd_kernel",)
_BWD = ("attn_bwd_preprocess_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel")
_KIND = {"attn_fwd_kernel": "fwd", "attn_bwd_preprocess_kernel": "fwd", "attn_bwd_dkdv_kernel": "bwd_dkdv",
         "attn_bwd_dq_kernel": "bwd_dq"}


def call_flags(params, varlen, alibi_slopes, head_dim: int) -> dict:
    """The launchers' constexpr flags for this call (``launch.feature_flags``), and ``IS_PAGED``."""
    from flash_attn.kernels import launch  # noqa: PLC0415

    features = launch.uses_score_features(params, alibi_slopes is not None)
    return dict(launch.feature_flags(params, features, varlen is not None, head_dim),
                IS_PAGED=varlen is not None and varlen.block_table is not None)


def required_specs(op: str, dtype, head_dim: int, capability: tuple[int, int], flags: dict,
                   return_softmax: bool = False) -> tuple[list, str]:
    """The specialisations ``op`` ("forward"/"backward") launches for this call on ``capability``,
    or ``([], why not)``."""
    if return_softmax:
        return [], S.NOT_SHIPPED["attn_probs_kernel"]
    out = []
    features = any(flags.get(name) for name in S.SCORE_FEATURES)
    for kernel in _FWD if op == "forward" else _BWD:
        config = configs.pick_config(_KIND[kernel], max(head_dim, 1), capability,
                                     features and kernel in S.FEATURE_KERNELS)
        spec, why = S.spec_for_call(kernel, dtype, head_dim, config, flags)
        if spec is None:
            return [], why
        out.append(spec)
    return out, ""


def _frozen(flags: dict) -> tuple:
    return tuple(sorted(flags.items()))


def call_reason(m: Manifest, capability: tuple[int, int], op: str, dtype, head_dim: int, flags: dict,
                return_softmax: bool = False) -> Optional[str]:
    """Why the shipped kernels cannot run this call on ``capability``, or ``None``."""
    return m.memo(("call", capability, op, dtype, head_dim, _frozen(flags), return_softmax),
                  lambda: _call_reason(m, capability, op, dtype, head_dim, flags, return_softmax))


def _call_reason(m, capability, op, dtype, head_dim, flags, return_softmax) -> Optional[str]:
    choice = m.image_for(capability)
    if not choice.supported:
        return choice.reason
    specs, why = required_specs(op, dtype, head_dim, config_capability(capability, choice), flags, return_softmax)
    if not specs:
        return why
    for spec in specs:
        if m.lookup(choice.arch.name, spec.key) is None:
            return f"{spec.key} is not in the {choice.arch.name} image set of this installation"
    return None


# --- the executor ---------------------------------------------------------------------------------

_registered: dict[tuple[str, str, str], int] = {}


def _arange_cu(device, batch: int, step: int) -> torch.Tensor:
    """``cu_seqlens = arange(batch + 1) * step`` of a dense call run as varlen."""
    if (batch + 1) * step > _I32[1]:
        raise AotUnsupported(f"{batch} x {step} rows overflow the kernels' int32 offsets")
    from flash_attn.kernels import launch  # noqa: PLC0415

    return launch.read_only_constant("arange", batch + 1, step, torch.int32, device)


def pack_arguments(entry: dict, names: list[str], values: dict) -> tuple[list, list, list]:
    """Tensors / ints / floats in signature order; ints range-checked (AotUnsupported)."""
    tensors, ints, floats = [], [], []
    tokens = [t for t in entry["signature"] if t not in _aot_library.HIDDEN_ARGS]
    if len(tokens) != len(names):
        raise RuntimeError(f"{entry['key']}: {len(names)} arguments for a signature of {len(tokens)}")
    for name, token in zip(names, tokens):
        value = values[name]
        ty = token.split(":")[0]
        if ty.startswith("*"):
            if not isinstance(value, torch.Tensor):
                raise RuntimeError(f"{entry['key']}: argument {name} must be a tensor, got {type(value).__name__}")
            if value.data_ptr() % 16 and name.startswith("CuSeqlens"):
                value = value.clone()
            tensors.append(value)
        elif ty.startswith("fp"):
            floats.append(float(value))
        else:
            value = int(value)
            if ty == "i32" and not _I32[0] <= value <= _I32[1]:
                raise AotUnsupported(f"argument {name} = {value} does not fit the kernels' int32")
            ints.append(value)
    return tensors, ints, floats


def config_capability(capability: tuple[int, int], choice: aot_images.ImageChoice) -> tuple[int, int]:
    """Whose launch configs a device runs: its own on a cubin (compiled for its family), and on
    the sm_80 PTX (a GPU newer than every cubin, e.g. sm_103 or sm_121) the configs that PTX was
    built with: the sm80 ones where the device has A100-sized shared memory, else sm86's."""
    if choice.kind != "ptx":
        return capability
    shared = configs.SHARED_MEMORY_LIMIT[configs.arch_family(capability)]
    return (8, 0) if shared >= configs.SHARED_MEMORY_LIMIT["sm80"] else (8, 6)


class AotExecutor:
    """Launches the launchers' calls on the precompiled images of one architecture."""

    def __init__(self, m: Manifest, arch: str, capability: Optional[tuple[int, int]] = None):
        self.manifest, self.arch = m, arch
        self.capability = capability  # whose launch configs (see config_capability)

    def resolve(self, kernel_name: str, dtype, head_dim: int, config, flags: dict) -> dict:
        entry, why = self.manifest.memo(("entry", self.arch, kernel_name, dtype, head_dim, tuple(config),
                                         _frozen(flags)),
                                        lambda: self._lookup(kernel_name, dtype, head_dim, config, flags))
        if entry is None:
            raise AotUnsupported(why)
        return entry

    def _lookup(self, kernel_name: str, dtype, head_dim: int, config, flags: dict) -> tuple[Optional[dict], str]:
        spec, why = S.spec_for_call(kernel_name, dtype, head_dim, config, flags)
        if spec is None:
            return None, why
        entry = self.manifest.lookup(self.arch, spec.key)
        if entry is None:
            return None, f"{spec.key} is not in the {self.arch} image set of this installation"
        return entry, ""

    def __call__(self, name: str, grid, args: list, flags: dict, config, device) -> None:
        """One launch of :func:`flash_attn.kernels.launch._run`: the kernel's name, its grid, the
        runtime arguments in signature order and the constexpr flags (no Triton involved)."""
        launch_names = [n for n in registry.arg_names(name) if n not in flags]
        values = dict(zip(launch_names, args))
        tensors = [v for v in args if isinstance(v, torch.Tensor)]
        # the element type of the specialisation: the first fp16/bf16 tensor (the decode combine
        # kernel starts with its fp32 partial results)
        first = next((t for t in tensors if t.dtype in _ELEMENT_DTYPES), tensors[0])
        cfg = configs.Config(flags.get("BLOCK_M", config.block_m), flags.get("BLOCK_N", config.block_n),
                             config.num_warps, config.num_stages)
        entry = self.resolve(name, first.dtype, int(values["head_dim"]), cfg, flags)
        if "IS_VARLEN" in flags and not flags["IS_VARLEN"]:
            for key, value in S.dense_as_varlen(launch_names, values, int(grid[2])).items():
                values[key] = _arange_cu(first.device, value[1], value[2]) if isinstance(value, tuple) else value
        spec_names = S.runtime_arg_names(name, entry["constexprs"])
        tensors, ints, floats = pack_arguments(entry, spec_names, values)
        reg_key = (str(self.manifest.folder), self.arch, entry["key"])
        kid = _registered.get(reg_key)
        if kid is None:
            kid = _aot_library.register_kernel(self.manifest.folder / entry["image"], entry)
            _registered[reg_key] = kid
        _aot_library.launch(kid, grid, tensors, ints, floats)


def _executor(device) -> AotExecutor:
    m, why = manifest()
    if m is None:
        raise AotUnsupported(why)
    capability = torch.cuda.get_device_capability(device)
    choice = m.image_for(capability)
    if not choice.supported:
        raise AotUnsupported(choice.reason)
    return AotExecutor(m, choice.arch.name, config_capability(capability, choice))


# --- the backend contract -------------------------------------------------------------------------


def _fallback(op: str, device, reason: str):
    from flash_attn import dispatch  # noqa: PLC0415

    target = "triton" if dispatch.unavailable_reason("triton", device) is None else "reference"
    dispatch.warn_once(f"aot:{op}:{reason}",
                       f"flash_attn: the aot backend has no precompiled kernel for this {op} ({reason}); "
                       f"running it on the {target} backend.")
    return dispatch._load(target)[0]


def _precheck(op, q, params, varlen, alibi_slopes, return_softmax=False) -> Optional[str]:
    from flash_attn.kernels import launch  # noqa: PLC0415

    why = launch.supported(op, q, varlen)
    if why is not None:
        return why
    m, why = manifest()
    if m is None:
        return why
    return call_reason(m, torch.cuda.get_device_capability(q.device), op, q.dtype, q.shape[-1],
                       call_flags(params, varlen, alibi_slopes, q.shape[-1]), return_softmax)


def forward(q, k, v, params, *, varlen=None, alibi_slopes=None, return_softmax=False):
    reason = _precheck("forward", q, params, varlen, alibi_slopes, return_softmax)
    if reason is None:
        from flash_attn.kernels import launch  # noqa: PLC0415

        try:
            executor = _executor(q.device)
            return launch.forward(q, k, v, params, varlen=varlen, alibi_slopes=alibi_slopes, executor=executor,
                                  capability=executor.capability)
        except AotUnsupported as exc:
            reason = str(exc)
    return _fallback("forward", q.device, reason).forward(
        q, k, v, params, varlen=varlen, alibi_slopes=alibi_slopes, return_softmax=return_softmax)


def backward(dout, q, k, v, out, lse, params, *, varlen=None, alibi_slopes=None, deterministic=False):
    reason = _precheck("backward", q, params, varlen, alibi_slopes)
    if reason is None:
        from flash_attn.kernels import launch  # noqa: PLC0415

        try:
            # deterministic: these kernels use no atomics
            executor = _executor(q.device)
            return launch.backward(dout, q, k, v, out, lse, params, varlen=varlen, alibi_slopes=alibi_slopes,
                                   executor=executor, capability=executor.capability)
        except AotUnsupported as exc:
            reason = str(exc)
    return _fallback("backward", q.device, reason).backward(
        dout, q, k, v, out, lse, params, varlen=varlen, alibi_slopes=alibi_slopes, deterministic=deterministic)


def kvcache_reason(m: Manifest, capability: tuple[int, int], dtype, head_dim: int) -> Optional[str]:
    """Why the shipped kernels cannot run a ``forward_kvcache`` of this dtype and head dim on
    ``capability``, or ``None``: every specialisation its head-dim bucket may launch (both split
    configs, each append / rotary variant, the combine) must be in the image set, so that a call
    never stops half-way (the append writes the cache in place)."""
    return m.memo(("kvcache", capability, dtype, head_dim), lambda: _kvcache_reason(m, capability, dtype, head_dim))


def _kvcache_reason(m, capability, dtype, head_dim) -> Optional[str]:
    from flash_attn.kernels import decode_configs  # noqa: PLC0415

    choice = m.image_for(capability)
    if not choice.supported:
        return choice.reason
    name = S.dtype_name(dtype)
    why = decode_configs.superset_refusal(name or str(dtype).replace("torch.", ""), head_dim, {})
    if why is not None:
        return why
    block_d = decode_configs.superset_block_d(head_dim)
    family = configs.arch_family(config_capability(capability, choice))
    for spec in S.decode_specs(family, name, block_d):
        if m.lookup(choice.arch.name, spec.key) is None:
            return f"{spec.key} is not in the {choice.arch.name} image set of this installation"
    return None


def forward_kvcache(q, params, cache, *, alibi_slopes=None):
    from flash_attn.kernels import decode_configs, decode_launch  # noqa: PLC0415

    m, reason = manifest()
    if m is not None:
        reason = kvcache_reason(m, torch.cuda.get_device_capability(q.device), q.dtype, q.shape[-1])
    if reason is None:
        try:
            executor = _executor(q.device)
            return decode_launch.forward_kvcache(q, params, cache, alibi_slopes=alibi_slopes, interpret=False,
                                                 executor=executor, superset=True,
                                                 family=configs.arch_family(executor.capability))
        except (AotUnsupported, decode_configs.DecodeLayoutUnsupported) as exc:
            # raised before the first launch (layout) or by the argument packing (int32 range); a
            # retry appends the same rows again, which is idempotent
            reason = str(exc)
    return _fallback("forward_kvcache", q.device, reason).forward_kvcache(
        q, params, cache, alibi_slopes=alibi_slopes)
