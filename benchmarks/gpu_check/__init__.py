"""One-command validation of Arbor on a CUDA machine (``python -m benchmarks.gpu_check``, or
``bash benchmarks/gpu_check.sh`` on a lent machine that lacks some packages).

Sections, each in its own process, correctness first: the test models are built; every triton
kernel is compared with its torch reference (``kernel_checks``); Engine greedy tokens on CUDA
float32 must equal CPU float32, bfloat16 agreement is reported (``engine_checks``); CUDA graphs
against eager when the runner has them; then ``benchmarks.kernel_bench`` and Engine decode
throughput (``speed``). One JSON result and a markdown table; exit code 1 when a gating check
failed, 2 without CUDA. ``--cpu-smoke`` runs the same harness on CPU at tiny sizes (triton
interpreted, benchmarks skipped) so that CI tests the harness.
"""
