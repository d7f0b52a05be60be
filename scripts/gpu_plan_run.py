"""The plan-and-run part of ``scripts/gpu_check.sh``: a tiny Llama (random weights, from a config)
converted to a store, planned on the GPU (``gds_offload.weights.plan``: measured there), streamed
with the plan and run layer-major (``generate_many``); every micro-batch's tokens are compared
with the resident model on the same GPU generating the same micro-batches.

Usage: python scripts/gpu_plan_run.py OUT.json [WORKDIR] [--device cpu]

The memory limit starts at 48 MiB (so that the plan streams some of the 6 layers) and doubles
while no plan fits it. Writes OUT.json (the plan, its prediction, the measured tokens/s,
``exact``) and exits 0 when the tokens are equal, 1 when they differ, 2 without CUDA
(``--device cpu``: the same run on the CPU, from 512 MiB, which a process's own memory needs).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv: list[str]) -> int:
    import torch
    import transformers

    from gds_offload.errors import ConfigError
    from gds_offload.weights import Generate, as_reference, convert, load_streamed, plan

    device = "cuda"
    if "--device" in argv:
        i = argv.index("--device")
        device, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
    if len(argv) not in (1, 2):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 64
    out = Path(argv[0])
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_plan_run: CUDA is not available", file=sys.stderr)
        return 2
    work = Path(argv[1]) if len(argv) == 2 else Path(tempfile.mkdtemp(prefix="gds_offload-plan-run-"))
    try:
        cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=8,
                                       num_key_value_heads=4, vocab_size=4096, max_position_embeddings=256, tie_word_embeddings=False)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(work / "ckpt")
        convert(work / "ckpt", work / "store")
        workload = Generate(prompts=24, prompt_len=32, new_tokens=8)
        t0 = time.perf_counter()
        memory, tried = (48 << 20) if device == "cuda" else (512 << 20), []
        while True:
            try:
                chosen = plan(work / "store", workload, memory=memory, device=device)
                break
            except ConfigError as exc:
                tried.append(f"{memory >> 20} MiB: {exc}")
                if len(tried) >= 5:
                    raise
                memory *= 2
        plan_s = time.perf_counter() - t0
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(1, cfg.vocab_size, (workload.prompt_len,), generator=g) for _ in range(workload.prompts)]
        with torch.device("meta"):
            skeleton = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        with load_streamed(skeleton, work / "store", device=device, plan=chosen) as lm:
            sync()
            t0 = time.perf_counter()
            many = lm.generate_many(prompts, max_new_tokens=workload.new_tokens, kv_path=work / "kv", seed=0, pad_token_id=0,
                                    do_sample=False, min_new_tokens=workload.new_tokens)
            sync()
            run_s = time.perf_counter() - t0
            stats = lm.stats()
        ref = as_reference(transformers.AutoModelForCausalLM.from_pretrained(work / "ckpt").to(device).eval())
        exact = True
        with torch.no_grad():
            for mb, got in zip(many.micro_batches, many.outputs):
                want = ref.generate(mb.input_ids.to(device), attention_mask=mb.attention_mask.to(device), max_new_tokens=workload.new_tokens,
                                    min_new_tokens=workload.new_tokens, do_sample=False, pad_token_id=0)
                exact = exact and torch.equal(got if isinstance(got, torch.Tensor) else got.sequences, want)
        doc = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "memory_limit": memory, "memory_refused": tried,
               "plan": chosen.describe(), "streamed_layers": len(stats.streamed_layers), "plan_s": plan_s, "run_s": run_s,
               "tokens_per_s": workload.prompts * workload.new_tokens / run_s, "predicted_tokens_per_s": chosen.predicted.tokens_per_s,
               "micro_batches": len(many.micro_batches), "bytes_read": stats.bytes_read, "engine": stats.engine, "exact": exact}
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(json.dumps(doc))
        return 0 if exact else 1
    finally:
        if len(argv) == 1:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
