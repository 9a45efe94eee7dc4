"""Prompt logprobs of a token sequence served by vLLM with a saved PEFT adapter, as JSON on stdout:
`python tests/e2e/vllm_adapter_logprobs.py MODEL_DIR ADAPTER_DIR 1,2,3,...`."""

import json
import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    model_dir, adapter_dir, ids = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
    llm = LLM(model=model_dir, dtype="float32", enable_lora=True, max_lora_rank=8, max_model_len=256,
              gpu_memory_utilization=0.3)
    output = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                          lora_request=LoRARequest("saved", 1, adapter_dir), use_tqdm=False)[0]
    print("LOGPROBS " + json.dumps([e[t].logprob for e, t in zip(output.prompt_logprobs[1:], ids[1:])]))
