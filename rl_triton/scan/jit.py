"""Triton, or a stand-in where it is not installed (macOS, Windows): the kernels' modules still
import, the torch and loop backends run, and `backend="triton"` says what is missing."""
try:
    import triton
    import triton.language as tl
    HAS_TRITON = True
except ImportError:  # pragma: no cover - Linux CI always has Triton
    HAS_TRITON = False

    class _Absent:
        """Any attribute or call is itself: enough to define (never run) the kernels."""

        def __getattr__(self, name):
            return self

        def __call__(self, *args, **kwargs):
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return args[0]  # used as a decorator
            return self

    triton = tl = _Absent()


def slots(inputs) -> tuple:
    """The kernel slot of every field of an op's input NamedTuple: its position, as the
    compile-time constants Triton requires of globals read inside kernels."""
    return tuple(tl.constexpr(i) for i in range(len(inputs._fields)))
