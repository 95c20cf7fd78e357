"""specd_kernels: Triton kernels for the specd runtime, with pure-torch references.

Every launcher has a ``*_ref`` twin with the same signature (pure torch, any device) that serves as
the oracle in tests. Kernels run compiled on CUDA, or on the CPU when ``TRITON_INTERPRET=1`` was
set before ``triton`` (and this package) were imported; :func:`interpreting` says which.
``batch_invariant`` holds the GEMM, RMSNorm and attention whose rows do not depend on the batch.
"""

from . import batch_invariant
from ._common import HAS_TRITON, interpreting
from .kv_ops import copy_slots, copy_slots_ref, write_kv, write_kv_ref
from .tree_attention import tree_attention, tree_attention_ref

__all__ = [
    "HAS_TRITON",
    "batch_invariant",
    "interpreting",
    "tree_attention",
    "tree_attention_ref",
    "write_kv",
    "write_kv_ref",
    "copy_slots",
    "copy_slots_ref",
]
