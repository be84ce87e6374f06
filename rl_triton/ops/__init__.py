"""One file per op: its input order, kernel coefficient builders, torch implementation,
custom op and public function (see `rl_triton._plans.Op`); the losses' kernels, autograd and
custom ops beside theirs (see `rl_triton.ops._losses`)."""
