"""One file per op: its input order, kernels, implementations, declaration (an `_core.op.Op`,
registered in `_core.op.OPS`; scans a `_core.scan.ScanOp`) and public function; what the losses
share in `_losses`, what the scans share in `_common` (docs/dev/op-framework.md)."""
