import numpy as np, torch, qkv, warnings
warnings.filterwarnings("ignore")
m = qkv.mask_fn(lambda b,h,qi,ki: abs(qi-ki) < 50)
for x in [np.zeros((1,4,512,64),np.float32), torch.zeros(1,4,512,64), torch.zeros(1,4,512,64).requires_grad_()]:
    for be in [None,"native","torch","numpy","reference"]:
        try: r = qkv.explain(x,x,x,m & qkv.causal(),backend=be); print(type(x).__name__, be, r.backend, r.workspace_bytes if hasattr(r,'workspace_bytes') else str(r).splitlines()[-1])
        except Exception as e: print(type(x).__name__, be, "FAIL", type(e).__name__)
