"""``gds-offload bench-plan``: the planner's choice run against what it predicted, the modes a
user would otherwise pick and the peers, on one model or a matrix of shapes."""
