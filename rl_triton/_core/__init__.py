"""The op framework (docs/dev/op-framework.md): `op` (the `Op` declaration, the registry `OPS`
and `ops()`, the one autograd path), `custom_ops` (the one custom-op registration), `plans`
(the plan cache and backend choice) and `scan` (what the scans add)."""
