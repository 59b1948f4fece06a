"""Experiment: split-K with the split's programs launched as one thread-block cluster (kernels.py, CLUSTER=1: ranks
1.. park their partial sums in their own shared memory, rank 0 reads them over DSMEM and adds them in split order;
CLUSTER=2: the cluster launch with the usual global-memory fixup). Checks both bit for bit against the fixup with
the same config, then times the dispatch against every cluster config (64/128-row tiles, 2-8 splits), one CUDA
graph each, replayed in turn. H100: python bench_cluster.py 1,16
"""
import json, sys, torch, math
import bench, kernels
from bench import SHAPES_7B, paired_us, random_nvfp4, copies_for
torch.manual_seed(0)
res = []
Ms = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [1, 16, 32, 48]
for name, (N, K) in SHAPES_7B.items():
    _, wq = random_nvfp4(N, K, copies_for(N * K * 9 // 16))
    KT = -(-K // 128)
    for M in Ms:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        base = kernels.mm_config(M, N, K)
        cands = []
        for BN in (64, 128):
            for sp in (2, 3, 4, 5, 6, 7, 8):
                s_eff, _ = kernels.split_k(KT, sp)
                if s_eff != sp or s_eff < 2: continue
                for st in (3,):
                    c = dict(base, BN=BN, SPLIT_K=sp, num_stages=st, CLUSTER=1)
                    if M > 8 and BN == 128: continue
                    cands.append(c)
        # correctness first: cluster vs park+count fixup with the same config
        for c in cands[:: max(1, len(cands) // 6)]:
            a = kernels.nvfp4_mm(x, wq[0], config=c)
            b = kernels.nvfp4_mm(x, wq[0], config=dict(c, CLUSTER=0))
            assert torch.equal(a, b), (name, M, c, (a.float() - b.float()).abs().max().item())
        c2 = dict(base, CLUSTER=2)
        if kernels.split_k(KT, base["SPLIT_K"])[0] <= 8 and base["SPLIT_K"] > 1:
            assert torch.equal(kernels.nvfp4_mm(x, wq[0], config=c2), kernels.nvfp4_mm(x, wq[0], config=dict(c2, CLUSTER=0)))
            cands.append(c2)
        lists = [[lambda w=w: kernels.nvfp4_linear(x, w) for w in wq]]
        lists += [[lambda w=w, c=c: kernels.nvfp4_mm(x, w, config=c) for w in wq] for c in cands]
        
        ts = paired_us(*lists, reps=3)
        tb, tc = ts[0], ts[1:]
        best = min(range(len(cands)), key=lambda i: tc[i])
        # same split / BN as the dispatch, with the cluster
        same = [t for c, t in zip(cands, tc) if c["BN"] == base["BN"] and c["SPLIT_K"] == kernels.split_k(KT, base["SPLIT_K"])[0] and c["num_stages"] == base["num_stages"]]
        row = dict(shape=name, M=M, dispatch_us=round(tb, 2), dispatch_cfg=base, cluster_best_us=round(tc[best], 2),
                   cluster_best=cands[best], cluster_same_cfg_us=round(same[0], 2) if same else None)
        if cands[-1].get("CLUSTER") == 2:
            row["cluster_launch_global_fixup_us"] = round(tc[-1], 2)
        print(json.dumps(row)); sys.stdout.flush()
