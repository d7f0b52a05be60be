"""What to offload: the policies (all, adaptive, budget) and the step profiles they plan with."""
