"""transformers' own tensor-parallel `generate` (run under torchrun by
tests/e2e/test_tensor_parallel.py): `python -m torch.distributed.run --nproc-per-node N
tests/e2e/tp_generate.py MODEL_DIR TOKENS PROMPT_IDS...`; rank 0 prints the greedy ids as JSON."""

import json
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

path, n, prompt = sys.argv[1], int(sys.argv[2]), [int(t) for t in sys.argv[3:]]
torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32).eval()
with torch.no_grad():
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
if dist.get_rank() == 0:
    print(json.dumps(out[0, len(prompt):].tolist()))
dist.destroy_process_group()
