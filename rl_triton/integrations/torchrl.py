"""TorchRL integration: value estimators whose recurrence runs in rl_triton.

`RLTritonGAE`, `RLTritonTDLambdaEstimator`, `RLTritonTD1Estimator` and `RLTritonVTrace` are
TorchRL's `GAE`, `TDLambdaEstimator`, `TD1Estimator` and `VTrace`: same constructor (plus
`backend=`), same keys, same `forward(tensordict, params=..., target_params=...)` and
`value_estimate(...)`, so a loss module takes them as its own::

    from torchrl.objectives import ClipPPOLoss
    from rl_triton.integrations.torchrl import RLTritonGAE, use_rl_triton

    loss = ClipPPOLoss(actor, critic)
    loss.make_value_estimator(RLTritonGAE(gamma=0.99, lmbda=0.95, value_network=critic))
    # or, for a loss (or estimator) that already has TorchRL's: one call swaps it in place
    use_rl_triton(loss)

How: the classes subclass TorchRL's and keep TorchRL's own method code (value-network calls,
`shifted`, `auto_reset_env`, advantage normalization, keys, masks); only the module-level
recurrence functions those methods call (`vec_generalized_advantage_estimate`,
`vec_td_lambda_return_estimate`, `vec_td1_return_estimate`, `vtrace_advantage_estimate`, and
their loop twins) are rebound, for these classes alone, to `rl_triton.gae`, `lambda_returns` and
`vtrace`. Importing this module fails loudly if a TorchRL release stops calling them.

Flags: TorchRL's `("next", "done")` (terminated or truncated) cuts the trace and
`("next", "terminated")` drops the bootstrap; the successor values are TorchRL's
`("next", value)` estimates, passed as `next_values`. This equals TorchRL's results wherever
`terminated` implies `done`, as TorchRL's environments guarantee.

TorchRL's own code still runs where rl_triton has no kernel: a per-step gamma
(`steps_to_next_obs`), `rolling_gamma` and float64 values. Inputs that carry gradients (a
`differentiable=True` estimator fed by a value network with live parameters) get them through
rl_triton's backward.

Importing this module imports TorchRL; `import rl_triton` does not.
"""
from __future__ import annotations

import contextvars
import functools
import types

import torch
from torchrl.objectives.value import advantages as _advantages
from torchrl.objectives.value.advantages import (GAE, TD1Estimator, TDLambdaEstimator,
                                                 ValueEstimatorBase, VTrace)

import rl_triton
from .._args import check_backend

__all__ = ["RLTritonGAE", "RLTritonTDLambdaEstimator", "RLTritonTD1Estimator", "RLTritonVTrace",
           "use_rl_triton", "revert_rl_triton"]

_backend = contextvars.ContextVar("rl_triton_torchrl_backend", default="auto")
_VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _scalar(x):
    """`x` as a Python float when it is a single number, else None (per-step tensors)."""
    if isinstance(x, torch.Tensor):
        return float(x) if x.numel() == 1 else None
    return float(x)


def _takes(*tensors) -> bool:
    """Whether rl_triton computes this call: value dtypes its kernels read."""
    return all(t is None or not t.is_floating_point() or t.dtype in _VALUE_DTYPES
               for t in tensors)


def _gae(torchrl_fn):
    def gae(gamma, lmbda, state_value, next_state_value, reward, done, terminated=None, *,
            time_dim=-2):
        g, lam = _scalar(gamma), _scalar(lmbda)
        if g is None or lam is None or not _takes(state_value, next_state_value, reward):
            return torchrl_fn(gamma, lmbda, state_value, next_state_value, reward, done=done,
                              terminated=terminated, time_dim=time_dim)
        terminated = done if terminated is None else terminated
        return rl_triton.gae(reward, state_value, terminated, done, next_values=next_state_value,
                              gamma=g, lam=lam, time_dim=time_dim, backend=_backend.get(),
                              out_dtype=state_value.dtype)
    return gae


def _lambda_returns(torchrl_fn):
    def lambda_returns(gamma, lmbda, next_state_value, reward, done, terminated=None,
                       rolling_gamma=None, *, time_dim=-2):
        g, lam = _scalar(gamma), _scalar(lmbda)
        if (g is None or lam is None or rolling_gamma is not None
                or not _takes(next_state_value, reward)):
            return torchrl_fn(gamma, lmbda, next_state_value, reward, done=done,
                              terminated=terminated, rolling_gamma=rolling_gamma,
                              time_dim=time_dim)
        terminated = done if terminated is None else terminated
        return rl_triton.lambda_returns(reward, None, terminated, done,
                                         next_values=next_state_value, gamma=g, lam=lam,
                                         time_dim=time_dim, backend=_backend.get(),
                                         out_dtype=next_state_value.dtype)
    return lambda_returns


def _td1_returns(torchrl_fn):
    def td1_returns(gamma, next_state_value, reward, done, terminated=None, rolling_gamma=None,
                    time_dim=-2):
        g = _scalar(gamma)
        if g is None or rolling_gamma is not None or not _takes(next_state_value, reward):
            return torchrl_fn(gamma, next_state_value, reward, done=done, terminated=terminated,
                              rolling_gamma=rolling_gamma, time_dim=time_dim)
        terminated = done if terminated is None else terminated
        return rl_triton.lambda_returns(reward, None, terminated, done,
                                         next_values=next_state_value, gamma=g, lam=1.0,
                                         time_dim=time_dim, backend=_backend.get(),
                                         out_dtype=next_state_value.dtype)
    return td1_returns


def _vtrace(torchrl_fn):
    def vtrace(gamma, log_pi, log_mu, state_value, next_state_value, reward, done,
               terminated=None, rho_thresh=1.0, c_thresh=1.0, time_dim=-2):
        g, rho, c = _scalar(gamma), _scalar(rho_thresh), _scalar(c_thresh)
        if (g is None or rho is None or c is None
                or not _takes(log_pi, log_mu, state_value, next_state_value, reward)):
            return torchrl_fn(gamma, log_pi, log_mu, state_value, next_state_value, reward, done,
                              terminated, rho_thresh=rho_thresh, c_thresh=c_thresh,
                              time_dim=time_dim)
        terminated = done if terminated is None else terminated
        # TorchRL's V-trace: lambda 1, the policy-gradient weight clipped like rho
        vs, pg_adv = rl_triton.vtrace(reward, state_value, terminated, log_pi, log_mu, done,
                                       next_values=next_state_value, gamma=g, lam=1.0,
                                       rho_clip=rho, c_clip=c, pg_rho_clip=rho,
                                       time_dim=time_dim, backend=_backend.get(),
                                       out_dtype=state_value.dtype)
        return pg_adv, vs
    return vtrace


_NUMERICS = {
    "generalized_advantage_estimate": _gae(_advantages.generalized_advantage_estimate),
    "vec_generalized_advantage_estimate": _gae(_advantages.vec_generalized_advantage_estimate),
    "td_lambda_return_estimate": _lambda_returns(_advantages.td_lambda_return_estimate),
    "vec_td_lambda_return_estimate": _lambda_returns(_advantages.vec_td_lambda_return_estimate),
    "vec_td1_return_estimate": _td1_returns(_advantages.vec_td1_return_estimate),
    "vtrace_advantage_estimate": _vtrace(_advantages.vtrace_advantage_estimate),
}
_GLOBALS = {**vars(_advantages), **_NUMERICS}


def _rebind(fn):
    """A copy of TorchRL's function `fn` that resolves module-level names in `_GLOBALS`. The
    wrappers around it (TorchRL's decorators, all `functools.wraps`) are copied around the copy."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        new = types.FunctionType(fn.__code__, _GLOBALS, fn.__name__, fn.__defaults__,
                                 fn.__closure__)
    else:
        new_inner = _rebind(inner)
        cells = fn.__closure__ or ()
        holds = [_cell_is(c, inner) for c in cells]
        if sum(holds) != 1:
            raise ImportError(f"rl_triton.integrations.torchrl cannot unwrap {fn.__qualname__} "
                              f"of this TorchRL release")
        closure = tuple(types.CellType(new_inner) if h else c for c, h in zip(cells, holds))
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                                 closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    new.__annotations__ = fn.__annotations__
    if inner is not None:
        new.__wrapped__ = new_inner
    return new


def _cell_is(cell, obj) -> bool:
    try:
        return cell.cell_contents is obj
    except ValueError:  # an empty cell
        return False


def _own_method(cls, name, calls):
    """TorchRL's `cls.name`, calling rl_triton for `calls`, under the instance's backend."""
    fn = cls.__dict__[name]
    innermost = fn
    while hasattr(innermost, "__wrapped__"):
        innermost = innermost.__wrapped__
    missing = [c for c in calls if c not in innermost.__code__.co_names]
    if missing:
        raise ImportError(f"rl_triton.integrations.torchrl: {cls.__name__}.{name} of this TorchRL "
                          f"release no longer calls {', '.join(missing)}")
    rebound = _rebind(fn)

    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        token = _backend.set(self.backend)
        try:
            return rebound(self, *args, **kwargs)
        finally:
            _backend.reset(token)
    return method


class _Backend:
    backend = "auto"  # class default, so that use_rl_triton can swap an instance's class

    def __init__(self, *args, backend: str = "auto", **kwargs):
        super().__init__(*args, **kwargs)
        check_backend(backend)
        self.backend = backend


class RLTritonGAE(_Backend, GAE):
    """TorchRL's `GAE` with the recurrence in `rl_triton.gae`. Arguments: those of TorchRL's GAE,
    plus `backend` ("auto": the Triton kernels on CUDA tensors, vectorized torch on CPU)."""

    forward = _own_method(GAE, "forward", ["vec_generalized_advantage_estimate",
                                           "generalized_advantage_estimate"])
    value_estimate = _own_method(GAE, "value_estimate", ["vec_generalized_advantage_estimate"])


class RLTritonTDLambdaEstimator(_Backend, TDLambdaEstimator):
    """TorchRL's `TDLambdaEstimator` with the recurrence in `rl_triton.lambda_returns`."""

    value_estimate = _own_method(TDLambdaEstimator, "value_estimate",
                                 ["vec_td_lambda_return_estimate", "td_lambda_return_estimate"])


class RLTritonTD1Estimator(_Backend, TD1Estimator):
    """TorchRL's `TD1Estimator` with the recurrence in `rl_triton.lambda_returns` (lambda 1)."""

    value_estimate = _own_method(TD1Estimator, "value_estimate", ["vec_td1_return_estimate"])


class RLTritonVTrace(_Backend, VTrace):
    """TorchRL's `VTrace` with the recurrence in `rl_triton.vtrace` (lambda 1; the policy-gradient
    weight clipped at `rho_thresh`, as TorchRL does)."""

    forward = _own_method(VTrace, "forward", ["vtrace_advantage_estimate"])


_SWAP = {GAE: RLTritonGAE, TDLambdaEstimator: RLTritonTDLambdaEstimator,
         TD1Estimator: RLTritonTD1Estimator, VTrace: RLTritonVTrace}
_UNSWAP = {new: old for old, new in _SWAP.items()}


def _estimator_of(obj):
    if isinstance(obj, ValueEstimatorBase):
        return obj
    estimator = getattr(obj, "value_estimator", None)  # a LossModule builds its default here
    if not isinstance(estimator, ValueEstimatorBase):
        raise TypeError(f"expected a TorchRL loss module or value estimator, got "
                        f"{type(obj).__name__}")
    return estimator


def use_rl_triton(loss_or_estimator, *, backend: str = "auto"):
    """Make a TorchRL loss module's value estimator (or an estimator itself) run its recurrence
    in rl_triton, in place: TorchRL's `GAE`, `TDLambdaEstimator`, `TD1Estimator` and `VTrace`
    become their rl_triton twins, with every setting kept. Returns the estimator.
    `revert_rl_triton` undoes it."""
    check_backend(backend)
    estimator = _estimator_of(loss_or_estimator)
    cls = type(estimator)
    if cls not in _UNSWAP:
        if cls not in _SWAP:
            raise TypeError(f"use_rl_triton knows TorchRL's {', '.join(c.__name__ for c in _SWAP)}"
                            f", not {cls.__name__}")
        estimator.__class__ = _SWAP[cls]
    estimator.backend = backend
    return estimator


def revert_rl_triton(loss_or_estimator):
    """Undo `use_rl_triton`: the estimator becomes TorchRL's own class again. Returns it."""
    estimator = _estimator_of(loss_or_estimator)
    if type(estimator) in _UNSWAP:
        estimator.__class__ = _UNSWAP[type(estimator)]
        estimator.__dict__.pop("backend", None)
    return estimator
