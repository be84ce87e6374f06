"""The benchmark's suites, one module each: `grid` (the estimators over the shape grid, the
default), `gradients` (its `--modes bwd,fwd+bwd`), `tokens`, `losses`, `host`, `head` and `llm`."""
