import torch, rl_triton
from rl_triton._triton import config
dev="cuda"
def case(seed, T=128, N=256):
    g=torch.Generator(device=dev).manual_seed(seed)
    return dict(rewards=torch.randn(T,N,device=dev,generator=g), values=torch.randn(T,N,device=dev,generator=g),
                terminated=torch.rand(T,N,device=dev,generator=g)<0.05, truncated=torch.rand(T,N,device=dev,generator=g)<0.05,
                last_value=torch.randn(N,device=dev,generator=g))
for n_seg in (1, 4):
    with config.override(n_seg=n_seg):
        static=case(0)
        eager0=rl_triton.gae(**static)
        s=torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            rl_triton.gae(**static)
        torch.cuda.current_stream().wait_stream(s)
        graph=torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            adv, ret = rl_triton.gae(**static)
        graph.replay(); torch.cuda.synchronize()
        print("n_seg", n_seg, "same inputs err", (adv-eager0[0]).abs().max().item())
        new=case(1)
        for k in static: static[k].copy_(new[k])
        graph.replay(); torch.cuda.synchronize()
        e=rl_triton.gae(**new)
        print("n_seg", n_seg, "new inputs err", (adv-e[0]).abs().max().item(), (ret-e[1]).abs().max().item())
