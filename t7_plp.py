import sys
import batchprompt as bp
from batchprompt import LLMEngine, SamplingParams
def mk(**kw): return LLMEngine.from_pretrained(dtype="float32", **kw)
eng = mk(max_num_batched_tokens=512)
tok = eng.tokenizer
pre = "The history of the Roman Empire spans many centuries and includes many emperors such as"
P = [pre + " Augustus, Nero and", pre + " Trajan.", "Completely different prompt about cats and dogs.", pre + " Augustus, Nero and"]
PL = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs_from=1, prompt_top_logprobs=3, prompt_ranks=True)
def key(o): return (o.prompt_logprobs, o.prompt_top_logprobs, o.prompt_ranks, o.output_token_ids)
alone = {}
for i,p in enumerate(P):
    e = mk(max_num_batched_tokens=512, enable_prefix_caching=False)
    alone[i] = key(e.generate([p], PL)[0]); del e
def cmp(name, outs, idx):
    bad=[]
    for o,i in zip(outs, idx):
        a = alone[i]; b = key(o)
        if a != b:
            # locate difference
            d = [n for n,(x,y) in enumerate(zip(a,b)) if x!=y]
            detail = ""
            if 0 in d and a[0] and b[0] is not None:
                diffs=[(j,x,y) for j,(x,y) in enumerate(zip(a[0],b[0])) if x!=y][:3]; detail=f"lp diffs {diffs} lens {len(a[0])} {len(b[0])}"
            if 2 in d: detail += f" ranks {a[2]} vs {b[2]}"
            if 1 in d and b[1] is not None: detail += f" tops first diff {[ (j,x,y) for j,(x,y) in enumerate(zip(a[1],b[1])) if x!=y][:1]}"
            bad.append((i, d, detail, o.error, o.num_cached_tokens))
    print(name, "OK" if not bad else bad, flush=True)
# prefix caching: same prompt twice, shared prefixes, sequentially
for i in [0,0,1,3]:
    o = eng.generate([P[i]], PL)[0]; cmp(f"seq-cached p{i} cached={o.num_cached_tokens}", [o], [i])
# in a batch with ordinary requests
G = SamplingParams(max_tokens=6, temperature=0)
outs = eng.generate(P + [pre + " Caesar", "Hello"], [PL]*4 + [G, G])
cmp("batch+ordinary", outs[:4], [0,1,2,3])
# n>1 with prompt logprobs
try:
    o = eng.generate([P[1]], SamplingParams(max_tokens=4, temperature=0.7, n=2, seed=1, prompt_logprobs_from=1, prompt_top_logprobs=3, prompt_ranks=True))[0]
    print("n=2 plp", o.prompt_logprobs == alone[1][0], o.prompt_ranks == alone[1][2], o.error)
except Exception as ex: print("n=2 raised", repr(ex))
# from > 1, partially cached
o = eng.generate([P[0]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs_from=5, prompt_ranks=True, prompt_top_logprobs=2))[0]
print("from=5", o.prompt_logprobs == alone[0][0][4:], o.prompt_ranks == alone[0][2][4:], o.prompt_top_logprobs == alone[0][1][4:])
# preemption: tiny KV
for kv, mbt in [(3_000_000, 16), (2_500_000, 64)]:
    e2 = mk(max_num_batched_tokens=mbt, kv_cache_memory=kv, max_num_seqs=4)
    outs = e2.generate(P + [pre + " Caesar", "Hello"]*3, [PL]*4 + [SamplingParams(max_tokens=30, temperature=0)]*6)
    print("preempt", kv, mbt, "preemptions", sum(o.num_preemptions for o in outs), [o.error for o in outs if o.error][:2])
    cmp(f"preempt kv={kv}", outs[:4], [0,1,2,3])
    outs = e2.generate(P, PL); cmp("preempt engine again (cached)", outs, [0,1,2,3])
    print("used", e2.pool.num_used)
