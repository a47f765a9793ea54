"""Triton kernels for the ops in ``kernels.ops``; importing this package registers each one
as the op's "triton" implementation with ``kernels.dispatch``.

Imported lazily by ``kernels.dispatch`` when a triton implementation is wanted (CUDA tensors,
or the backend forced to "triton"); an ImportError here leaves the torch path untouched. On a
CPU-only machine the kernels run on CPU tensors under the triton interpreter, which needs
``TRITON_INTERPRET=1`` in the environment before triton is first imported.
"""

from arbor_kernels.triton_ops import (  # noqa: F401  (registers the triton implementations)
    activation,
    bitmask,
    decode_attention,
    extend_attention,
    norm,
    rotary,
    sampling,
)
