"""The weight benchmarks (``bench-weights``, ``bench-finetune``): parents, children, the drive's own figures."""
