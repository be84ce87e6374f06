
import torch, triton, triton.language as tl

@triton.jit
def comb(a1, b1, a2, b2):
    return a2 + b2 * a1, b1 * b2

@triton.jit
def coef(ins, st, t, mask):
    a = tl.load(ins[0] + t * st[0], mask=mask, other=0.0)
    b = tl.load(ins[1] + t * st[1], mask=mask, other=1.0)
    return a, b

@triton.jit
def k(ins, st, out, T, C: tl.constexpr, REV: tl.constexpr, BT: tl.constexpr):
    t = tl.arange(0, BT)
    m = t < T
    a, b = C(ins, st, t, m)
    x, y = tl.associative_scan((a, b), 0, comb, reverse=REV)
    tl.store(out + t, x, mask=m)

T=7000
a=torch.randn(T,device="cuda"); b=torch.rand(T,device="cuda")
out=torch.empty(T,device="cuda")
k[(1,)]((a.cuda().float(),b.cuda().float()) if a.device.type=="cpu" else (a,b),(1,1),out,T,C=coef,REV=True,BT=8192)
a=a.cpu().double(); b=b.cpu().double(); ref=torch.zeros(T,dtype=torch.float64); acc=0.
for i in reversed(range(T)):
    acc=a[i]+b[i]*acc; ref[i]=acc
print("rev", (out.cpu().double()-ref).abs().max())
k[(1,)]((a.cuda().float(),b.cuda().float()) if a.device.type=="cpu" else (a,b),(1,1),out,T,C=coef,REV=False,BT=8192)
acc=0.
for i in range(T):
    acc=a[i]+b[i]*acc; ref[i]=acc
print("fwd", (out.cpu().double()-ref).abs().max())
