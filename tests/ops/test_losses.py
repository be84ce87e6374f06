@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
def test_loss_offsets_checked_on_every_call(backend):
    """The losses that take cu_seqlens read their offsets on every call too (edits through a
    NumPy view included); check_offsets=False skips the read, and must be a bool."""
    g = torch.Generator().manual_seed(0)
    dev = DEVICE if backend == "triton" else "cpu"  # offsets on the CPU (a NumPy view edits them)
    lp, old, adv, v, ret = (torch.randn(7, generator=g).to(dev) for _ in range(5))
    cu = torch.tensor([0, 3, 7])
    calls = [lambda **kw: rl_triton.ppo_policy_loss(lp, old, adv, cu_seqlens=cu,
                                                    aggregation="seq-mean-token-mean",
                                                    backend=backend, **kw)[0],
             lambda **kw: rl_triton.value_loss(v, ret, cu_seqlens=cu,
                                               aggregation="seq-mean-token-sum",
                                               backend=backend, **kw)]
    for call in calls:
        want = call()
        cu.numpy()[1] = 9
        for _ in range(2):
            with pytest.raises(ValueError, match="cu_seqlens"):
                call()
        assert call(check_offsets=False).isfinite()  # unread: no error, inside the tensors
        cu.numpy()[1] = 3
        torch.testing.assert_close(call(check_offsets=False), want)
        with pytest.raises(TypeError, match="check_offsets must be a bool"):
            call(check_offsets="no")
