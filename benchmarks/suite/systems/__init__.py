"""The systems a workload runs on: Arbor, and the baselines that replay its calls."""
