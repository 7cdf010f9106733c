"""The launch planner: one attention call -> the kernel launches that compute it. This module is
its public face (what the backends and tests call); each stage is a module of its own.

A call is first reduced to its *shape* (:mod:`.shapes`: :func:`describe_forward`,
:func:`describe_backward`, :func:`describe_kvcache`): dtypes, sizes, strides, alignment and the
scalar options, everything the launches depend on and nothing that changes between two calls of
the same layout. A :class:`Plan` (:mod:`.launches`) is a pure function of a shape and a
:class:`Target`: the kernels by name, their grids, their arguments by name (tensors as
:class:`Slot` names, sizes and scalars as numbers), compile-time constants and launch configs, the
buffers to allocate and the inputs to bring into the kernels' layout first (:mod:`.layouts`).
:func:`plan_forward` (:mod:`.forward`), :func:`plan_backward` (:mod:`.backward`) and
:func:`plan_kvcache` (:mod:`.kvcache`) make them, with what the attention planners share in
:mod:`.attention`. The kernel backends (``triton``, ``interpret``, ``aot``) cache plans per shape
and execute them; per call only tensors are filled into slots.

A planner returns a :class:`Refusal` instead of a plan when the kernels cannot run the call; the
dispatcher then falls back to another backend. Nothing here imports Triton, touches a device or
reads a tensor value, so plans are made (and tested) anywhere, also for meta tensors.
"""

from flash_attn.planning.attention import uses_score_features
from flash_attn.planning.backward import plan_backward
from flash_attn.planning.extents import Extent, filled, reader as extent_reader, template
from flash_attn.planning.forward import KEY_EXTENTS, plan_forward, shared_by_key_lengths
from flash_attn.planning.kvcache import choose_num_splits, plan_kvcache
from flash_attn.planning.launches import DRIVER, IMAGES, PLANNER, Launch, Plan, Planned, Refusal, Target
from flash_attn.planning.layouts import Buffer, Prepare
from flash_attn.planning.shapes import (K_ROWS, Q_ROWS, Rows, Slot, TensorInfo, bucket_seqlen, describe_backward,
                                        describe_forward, describe_kvcache)

__all__ = [
    "Slot", "Rows", "Q_ROWS", "K_ROWS", "Target", "TensorInfo", "Launch", "Buffer", "Prepare", "Plan", "Planned",
    "Refusal", "PLANNER", "IMAGES", "DRIVER", "describe_forward", "describe_backward", "describe_kvcache",
    "bucket_seqlen", "plan_forward", "plan_backward", "plan_kvcache", "choose_num_splits", "uses_score_features",
    "Extent", "template", "filled", "extent_reader", "SHARED_KEYS",
]

# Planners whose plans are shared across calls that differ only in some extents
# (:mod:`flash_attn.planning.extents`): planner -> (shape -> shared key or None, the arguments left to each call).
SHARED_KEYS = {plan_forward: (shared_by_key_lengths, KEY_EXTENTS)}
