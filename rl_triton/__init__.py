"""rl_triton: fused GPU kernels for reinforcement-learning credit assignment.

Every estimator is one first-order linear recurrence `A[t] = alpha[t] + beta[t] * A[t+1]`,
evaluated as an associative scan. See `rl_triton.estimators` for the shared conventions
(layouts, flags, bootstraps, autoreset) and `rl_triton.reference` for the sequential definitions.
"""
from .estimators import (discounted_returns, eligibility_traces, episodic_cumsum, gae,
                         lambda_returns, linear_scan, retrace, vtrace)

__version__ = "0.1.0"

__all__ = ["linear_scan", "gae", "lambda_returns", "discounted_returns", "vtrace", "retrace",
           "eligibility_traces", "episodic_cumsum"]
