"""Batched, stopping generation on a CUDA GPU against transformers' ``generate`` on the same GPU
(greedy cached and uncached, seeded sampling), lib on the CPU against the same reference, and
lib's bf16 generation with and without the KV cache. The models are the small random Llama- and
GPT-2-shaped ones of tests/test_generate.py. Run from the repository root on a machine with CUDA:

    python benchmarks/generate_cuda_check.py

It prints one line per comparison and ALL SAME at the end (the run in docs/benchmarks.md).
"""
import sys
import torch
sys.path.insert(0, "tests")
from test_generate import PAD, PROMPTS, gpt2, left_pad, llama, ours, theirs  # noqa: E402
from lib.pretrained import from_hf  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
ok = True
def check(name, a, b):
    global ok
    same = torch.equal(a.cpu(), b.cpu())
    ok &= same
    print(f"{name:62s} {'same' if same else 'DIFFERENT'}", flush=True)

print(torch.__version__, DEV, torch.cuda.get_device_name(0) if DEV == "cuda" else "")
import transformers; print("transformers", transformers.__version__)
for make in (llama, gpt2):
    hf = make()
    cpu = from_hf(hf.state_dict(), hf.config.to_dict())
    hf = hf.to(DEV)
    gpu = from_hf(hf.state_dict(), hf.config.to_dict()).to(DEV)
    ids, mask = left_pad(PROMPTS, pad_id=PAD)
    ids_c, mask_c = ids.to(DEV), mask.to(DEV)
    for stop in (None, 64, 54):
        ref = theirs(hf, ids_c, mask_c, 20, stop=stop)
        check(f"{make.__name__} greedy stop={stop}: lib {DEV} vs hf {DEV}", ours(gpu, ids_c, mask_c, 20, stop=stop), ref)
        check(f"{make.__name__} greedy stop={stop}: lib {DEV} uncached vs hf", ours(gpu, ids_c, mask_c, 20, stop=stop, use_cache=False), ref)
        check(f"{make.__name__} greedy stop={stop}: lib cpu vs hf {DEV}", ours(cpu, ids, mask, 20, stop=stop), ref)
    for seed in (0, 1):
        ref = theirs(hf, ids_c, mask_c, 16, stop=21, seed=seed, temperature=0.8, top_k=20)
        check(f"{make.__name__} sampling seed={seed}: lib {DEV} vs hf {DEV}", ours(gpu, ids_c, mask_c, 16, stop=21, seed=seed, temperature=0.8, top_k=20), ref)
    with torch.no_grad():
        logits, _ = gpu(ids_c, attention_mask=mask_c)
    finite = bool(torch.isfinite(logits).all())
    print(make.__name__, "padded forward finite everywhere (pads too):", finite)
    ok &= finite
    half = from_hf(hf.state_dict(), hf.config.to_dict(), dtype=torch.bfloat16).to(DEV)
    check(f"{make.__name__} bf16 cached vs uncached", ours(half, ids_c, mask_c, 20, stop=64), ours(half, ids_c, mask_c, 20, stop=64, use_cache=False))
print("ALL SAME" if ok else "SOME DIFFER")
