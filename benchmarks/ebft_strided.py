"""What EBFT strided sampling gains from sharing each document between its samples and from a KV cache.

    .venv/bin/python -m benchmarks.ebft_strided            # ~1 minute on 2 cores

A script, not part of the gated suite. One step's sampling of DOCUMENTS documents of DOC_LENGTH tokens,
NUM_SAMPLES samples of every block (anchors every STRIDE tokens, GENERATE tokens per block), with the
tiny Qwen2 policy, three ways, all with driver/ebft/strided_generate.py and the same dense mask:

- "n copies, recompute": each sample repeats its document and every step is a forward of the whole
  row so far: the official implementation's and axolotl's algorithm.
- "shared document, recompute": the n samples attend to one copy of the document.
- "shared document, KV cache" (ours, the default): one prefill of the documents, then each step
  forwards only the previous step's tokens.

Reported: median seconds over REPEATS runs after a warm-up, and the tokens each way pushes through
the model (rows forwarded, summed over the steps).
"""

from __future__ import annotations

import statistics
import time

import torch

DOCUMENTS, DOC_LENGTH, NUM_SAMPLES = 4, 256, 4
STRIDE, CONTEXT, GENERATE = 8, 8, 8
REPEATS = 3


def rows_forwarded(layouts, num_samples: int, kv_cache: bool) -> int:
    documents = sum(layout.doc_length for layout in layouts)
    units = num_samples * sum(layout.num_blocks() for layout in layouts)
    if kv_cache:
        return documents + units * (GENERATE - 1)
    return sum(documents + step * units for step in range(GENERATE))


def main() -> None:
    from driver.config import Config
    from driver.ebft.strided_generate import sample_strided
    from driver.ebft.strided_layout import strided_layout
    from driver.policy.model import load_policy

    torch.manual_seed(0)
    model = load_policy(Config.model_validate({"lora": {"r": 8}})).model
    documents = [torch.randint(10, 300, (DOC_LENGTH,)).tolist() for _ in range(DOCUMENTS)]
    layout = strided_layout(DOC_LENGTH, STRIDE, CONTEXT, GENERATE)
    # Each way forwards one row per document (per copy for the first), as the reference code's batch
    # rows do: a packed row would add the cross-document part of the dense mask to every way.
    runs = {
        "n copies, recompute (official / axolotl)": [([d], 1, False) for d in documents for _ in range(NUM_SAMPLES)],
        "shared document, recompute": [([d], NUM_SAMPLES, False) for d in documents],
        "shared document, KV cache (ours)": [([d], NUM_SAMPLES, True) for d in documents],
    }
    print(f"{DOCUMENTS} documents x {DOC_LENGTH} tokens, {NUM_SAMPLES} samples, {layout.num_blocks()} blocks of "
          f"{GENERATE} tokens each (stride {STRIDE}, context {CONTEXT}); tiny Qwen2 on {torch.get_num_threads()} "
          "threads")
    print("| run | rows forwarded | median s | speed-up |\n|---|---|---|---|")
    baseline = None
    for name, calls in runs.items():
        times = []
        for repeat in range(REPEATS + 1):
            generator = torch.Generator().manual_seed(repeat)
            started = time.perf_counter()
            for docs, num_samples, kv_cache in calls:
                sample_strided(model, docs, [layout], num_samples, temperature=1.0, generator=generator,
                               kv_cache=kv_cache)
            if repeat:  # the first run warms up
                times.append(time.perf_counter() - started)
        median = statistics.median(times)
        baseline = baseline or median
        rows = sum(rows_forwarded([layout], num_samples, kv_cache) for _, num_samples, kv_cache in calls)
        print(f"| {name} | {rows} | {median:.2f} | {baseline / median:.2f}x |")

if __name__ == "__main__":
    main()
