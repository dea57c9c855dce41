"""transformers' `generate` on tensor-parallel shards (run under torchrun by
tests/e2e/test_tensor_parallel.py): `python -m torch.distributed.run --nproc-per-node N
tests/e2e/tp_generate.py {transformers,kvserve} MODEL_DIR TOKENS PROMPT_IDS...`; rank 0 prints the
greedy ids as JSON. "transformers": the shards as transformers' plan loads and runs them;
"kvserve": as kvserve loads them (server/model_loader.py: the plan, then `sharding.localize`'s
local weights and hooks), run by transformers' own modeling code."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

shards, path, n, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), [int(t) for t in sys.argv[4:]]
torch.set_num_threads(1)
if shards == "kvserve":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from server.model_loader import load_model

    dist.init_process_group("gloo")
    model = load_model(path, cache_dir=Path(path), device="cpu", dtype="float32", tensor_parallel=dist.get_world_size()).model
else:
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32).eval()
with torch.no_grad():
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
if dist.get_rank() == 0:
    print(json.dumps(out[0, len(prompt):].tolist()))
dist.destroy_process_group()
