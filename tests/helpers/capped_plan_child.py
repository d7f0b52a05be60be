"""``from_pretrained(CKPT, STORE, memory=MEMORY, workload=Generate(...))`` in a process that waits,
before importing anything large, for a line on stdin: the parent moves it into a memory cgroup
first (``test_weights_plan_capped.py``). Prints the plan, the generated tokens and
the micro-batches as one JSON line.

Usage: ``python capped_plan_child.py CKPT STORE MEMORY [isolate]``.
"""
from __future__ import annotations

import json
import sys

if __name__ == "__main__":
    sys.stdin.readline()  # moved into the cap
    import torch

    from gds_offload.weights import from_pretrained
    from gds_offload.weights.planning.planner import Generate
    from gds_offload.weights.run import plan as planning

    ckpt, store, memory = sys.argv[1:4]
    if sys.argv[4:] == ["isolate"]:  # the measuring child beside this process
        original = planning.measure
        planning.measure = lambda *a, **kw: original(*a, **kw, isolate=True)  # type: ignore[assignment]
    workload = Generate(prompts=8, prompt_len=8, new_tokens=4)
    with from_pretrained(ckpt, store=store, memory=memory, workload=workload) as lm:
        ids = torch.randint(1, 200, (8, 8), generator=torch.Generator().manual_seed(0))
        out = lm.generate_many(list(ids), max_new_tokens=4, pad_token_id=0)
        print(json.dumps({"plan": lm.plan.describe(), "tokens": [t.tolist() for t in out.tokens],
                          "micro_batches": [list(mb.indices) for mb in out.micro_batches]}), flush=True)  # fmt: skip
