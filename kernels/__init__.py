"""Kernels: torch reference implementations and triton kernels behind one dispatch point.

The import name is ``arbor_kernels`` (the folder keeps the layout's name, ``kernels``). The name
``kernels`` belongs to Hugging Face's package, which transformers imports; a process whose
``sys.path`` holds the repository root (``python -m pytest`` there, ``python -c`` in the checkout)
would otherwise find this folder under that name first. The guard below hands the name over.
"""

if __name__ == "kernels":  # this folder was found by path, under the other package's name
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.realpath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is None or _spec.origin is None or _spec.loader is None:  # none, or a namespace
        del sys.modules["kernels"]
        raise ModuleNotFoundError(
            "No module named 'kernels' (the folder kernels/ here is Arbor's package arbor_kernels)",
            name="kernels",
        )
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # the import statement returns what sys.modules holds
    _spec.loader.exec_module(_module)
else:
    from arbor_kernels import reference  # noqa: F401  (registers the torch implementations)
    from arbor_kernels.dispatch import (
        BACKENDS,
        deterministic,
        graph_safe,
        kernel_backend,
        native_available,
        runs_natively,
        set_deterministic,
        set_kernel_backend,
    )
    from arbor_kernels.ops import (
        apply_rotary_emb,
        apply_token_bitmask,
        decode_attention,
        decode_attention_with_lse,
        decode_self_attention,
        extend_attention,
        fixed_order_linear,
        fused_add_rms_norm,
        gather_kv_chunks,
        merge_attention_states,
        quantized_linear,
        quantized_rows,
        rms_norm,
        row_max_argmax,
        sample_from_probs,
        shared_prefix_attention,
        silu_and_mul,
    )
    from arbor_kernels.reference.sampling import filter_probs, row_uniform

    __all__ = [
        "BACKENDS",
        "apply_rotary_emb",
        "apply_token_bitmask",
        "decode_attention",
        "decode_attention_with_lse",
        "decode_self_attention",
        "deterministic",
        "extend_attention",
        "filter_probs",
        "fixed_order_linear",
        "fused_add_rms_norm",
        "gather_kv_chunks",
        "graph_safe",
        "kernel_backend",
        "merge_attention_states",
        "native_available",
        "quantized_linear",
        "quantized_rows",
        "rms_norm",
        "row_max_argmax",
        "row_uniform",
        "runs_natively",
        "sample_from_probs",
        "set_deterministic",
        "set_kernel_backend",
        "shared_prefix_attention",
        "silu_and_mul",
    ]
