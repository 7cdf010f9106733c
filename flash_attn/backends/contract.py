"""The backend contract as one object per backend: what the dispatcher may call, by name.

Every backend module defines ``BACKEND``, a :class:`Backend`; :mod:`flash_attn.dispatch` reaches
backends only through it. The three operations (:data:`OPS`) and their arguments:

``forward(q, k, v, params, *, varlen=None, alibi_slopes=None, return_softmax=False)``
    -> ``(out, lse, s_dmask)``.
    Dense: q ``(b, sq, h, d)``, k/v ``(b, sk, hk, d)``; out like q, lse fp32 ``(b, h, sq)``.
    Varlen (``varlen`` a :class:`~flash_attn.params.VarlenLayout`): q ``(total_q, h, d)``,
    k/v ``(total_k, hk, d)`` or paged; out like q, lse fp32 ``(h, total_q)``.
    ``s_dmask`` is ``None`` unless ``return_softmax``; then fp32 ``(b, h, max_sq, max_sk)`` holding
    the softmax probabilities, negated where dropout dropped the entry.
    Rows that see no key: out 0, lse +inf.

``backward(dout, q, k, v, out, lse, params, *, varlen=None, alibi_slopes=None,
deterministic=False, grads=None, return_delta=False)`` -> ``(dq, dk, dv)`` shaped like q, k, v
(for paged K/V: like the page pool).
    The probabilities are recomputed from the given ``lse`` and the softmax correction
    ``rowsum(dout * out)`` from the given ``out``, never from a fresh forward: given the ``out``
    and ``lse`` of a longer sequence (context parallelism), the result is this block's share.
    ``grads``: the caller's ``(dq, dk, dv)`` (each may be ``None``), which a backend may write in
    place and return; ``return_delta``: a fourth result, Delta ``rowsum(dout * out)`` fp32 shaped
    like lse (both for the low-level API, :mod:`flash_attn.lowlevel`).

``forward_kvcache(q, params, cache, *, alibi_slopes=None)`` -> ``(out, lse)``
    ``cache`` a :class:`~flash_attn.params.KVCacheInputs`; q ``(b, sq, h, d)``; appends
    ``cache.k_new``/``v_new`` into the cache in place (after rotary on k) before attending.

Arguments arrive already validated and normalised by :mod:`flash_attn.flash_attn_interface`
(dtypes, shapes, devices, value ranges), so a backend only computes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping, NamedTuple, Optional, Union

import torch

from flash_attn.planning.plan import Refusal

OPS = ("forward", "backward", "forward_kvcache")
# the ops whose eager calls of a held signature may take a lane (``Backend.lane``): all three (the
# backward's lane holds the gradient's strides and the options its plan key adds to the signature,
# and leaves the calls with others)
LANE_OPS = ("forward", "backward", "forward_kvcache")
# the ops whose plans a backend may hold outside Python for a public function (HeldLanes; the
# backward's for a training call's record, :class:`flash_attn.dispatch.HeldTraining`)
HELD_OPS = ("forward", "backward", "forward_kvcache")

Runner = Callable[[], tuple]
# prepare(*op_args, **op_kwargs) -> a runner that computes the call, or a Refusal saying who refused
# it and why (answered before anything runs, so the dispatcher can run the call elsewhere).
Prepare = Callable[..., Union[Runner, Refusal]]
# direct(*args of the flash_attn::<op> custom op) -> the op's outputs, or None: the call is not taken.
Direct = Callable[..., Optional[tuple]]
# known(device, call, *tensors and options) -> the op's results by the call's checked signature, or
# None: the backend refuses the call (see :func:`flash_attn.dispatch.run_known` for the arguments).
Known = Callable[..., Optional[tuple]]
# lane(op, device, call, *the known route's arguments of the call that made it) -> ((call, *the known
# route's arguments) -> its results, or None: the lane does not take the call), or None: no lane for
# the signature yet (see :func:`flash_attn.dispatch.run_lane`).
Lane = Callable[..., Optional[Callable[..., Optional[tuple]]]]
# class_lane(op, device, shared): a lane of the params.KeyLengths class ``shared`` rather than of one
# signature (see :func:`flash_attn.dispatch.run_lane`).
ClassLane = Callable[[str, torch.device, int], Optional[Callable[..., Optional[tuple]]]]


class HeldLanes(NamedTuple):
    """Lanes a backend holds outside Python (the ``aot`` backend's op library): a public call's
    route from its arguments to the launch in one call (see :func:`flash_attn.dispatch.run_held`).

    ``runner()``: ``run``, asked when a lane is held (the backend has loaded what runs it then):
    ``run(key, tensors)`` gives the results of the lane held under ``key`` that ``tensors`` (a
    sequence) fit (its ``results``, in order), or an empty list (none fits).
    ``holdable(op, call, slots, results)``: what :attr:`hold` takes to hold the plan of ``op``
    for checked signature ``call`` that the backend's direct lane last ran on this thread, if the
    tensors it passes are among ``slots`` (the public function's, in its order) and ``results``
    (slot names) are among its buffers, each contiguous (the lane returns them alone, in this
    order); else ``None``.
    ``hold(key, holdable, tensors)``: hold it under ``key``, for tensors like ``tensors`` passed in
    the order of ``slots``. ``clear()``: forget every lane held. ``forget_run()``: forget the
    direct lane's last run on this thread (as reading it with ``holdable`` does)."""

    runner: Callable[[], Callable[[int, list], list]]
    holdable: Callable[[str, object, tuple, tuple], Optional[object]]
    hold: Callable[[int, object, tuple], None]
    clear: Callable[[], None]
    forget_run: Callable[[], object]


@dataclass(slots=True)
class Backend:
    """One backend, as the dispatcher sees it.

    ``unavailable_reason(device)``: ``None`` when the backend can run tensors on ``device``, else a
    sentence saying why not. ``prepare``: one :data:`Prepare` per op of :data:`OPS`. ``direct``:
    optional eager routes around the custom op (only the ``cpu`` backend has one, for the plain
    forward calls it takes; see :func:`flash_attn.dispatch.run_direct`). ``known``: optional
    routes for eager calls with a checked signature, by the plan the backend holds for it (the
    kernel backends; :func:`flash_attn.dispatch.run_known`). ``lane``: optional, the lane of a
    signature's later eager calls once the known route has run one (the kernel backends;
    :func:`flash_attn.dispatch.run_lane`); ``class_lane``: optional, the lane of the signatures of
    a class whose new signatures' plans are filled in from the class's template
    (:class:`~flash_attn.params.KeyLengths`); ``held``: optional, lanes held outside Python
    (:class:`HeldLanes`, the ``aot`` backend's). ``failure``: the
    exception type by which the backend says *it* failed on first use, not the call (Triton's
    compiler or cache: ``scope`` ``"backend"`` or ``"plan"``); the dispatcher then runs the call on
    the next backend. ``settings_error()``: why the backend's own environment settings are invalid
    (``None`` when they are valid); the dispatcher then raises it for every call, which is what the
    doctor reports (:func:`flash_attn.dispatch.route`).
    """

    name: str
    unavailable_reason: Callable[[torch.device], Optional[str]]
    prepare: Mapping[str, Prepare]
    direct: Mapping[str, Direct] = field(default_factory=lambda: MappingProxyType({}))
    failure: Optional[type[BaseException]] = None
    settings_error: Callable[[], Optional[str]] = lambda: None
    known: Mapping[str, Known] = field(default_factory=lambda: MappingProxyType({}))
    lane: Optional[Lane] = None
    class_lane: Optional[ClassLane] = None
    held: Optional[HeldLanes] = None

    def __post_init__(self):
        if set(self.prepare) != set(OPS) or not set(self.direct) <= set(OPS) or not set(self.known) <= set(OPS):
            raise ValueError(f"backend {self.name!r}: prepare must name exactly {OPS}, direct and known a subset "
                             f"(got {sorted(self.prepare)}, {sorted(self.direct)}, {sorted(self.known)})")
        self.prepare = MappingProxyType(dict(self.prepare))
        self.direct = MappingProxyType(dict(self.direct))
        self.known = MappingProxyType(dict(self.known))


def runs_every_call(name: str, unavailable_reason, forward, backward, forward_kvcache,
                    direct: Optional[Mapping[str, Direct]] = None,
                    settings_error: Callable[[], Optional[str]] = lambda: None) -> Backend:
    """A backend that refuses no call it can run (cpu, reference): each op's runner calls the
    given function with the call's arguments."""

    def preparing(op: Callable) -> Prepare:
        return lambda *args, **kwargs: lambda: op(*args, **kwargs)

    return Backend(name, unavailable_reason,
                   {"forward": preparing(forward), "backward": preparing(backward),
                    "forward_kvcache": preparing(forward_kvcache)},
                   direct or {}, settings_error=settings_error)


def cuda_tensor_reason(device: torch.device, what_it_does: str) -> Optional[str]:
    """Why a backend of GPU kernels cannot take tensors on ``device``: they are not CUDA tensors
    ("it <what_it_does> and needs CUDA tensors, not cpu"; ROCm PyTorch's GPU tensors are CUDA
    tensors too); ``None`` when they are."""
    if device.type != "cuda":
        return f"it {what_it_does} and needs CUDA tensors, not {device.type}"
    return None


def nvidia_cuda_reason(device: torch.device, what_it_does: str, not_rocm: str) -> Optional[str]:
    """Why a backend of NVIDIA GPU kernels cannot take tensors on ``device`` at all: they are not
    CUDA tensors (:func:`cuda_tensor_reason`), or PyTorch is a ROCm build ("<not_rocm>, not ROCm");
    ``None`` when neither holds."""
    reason = cuda_tensor_reason(device, what_it_does)
    if reason is None and getattr(torch.version, "hip", None):
        return f"{not_rocm}, not ROCm"
    return reason
