"""The workload suite behind ``arbor bench``: SGLang-paper-style workloads, Arbor vs baselines."""
