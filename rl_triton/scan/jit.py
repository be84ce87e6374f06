"""Triton, or a stand-in where it is not installed (macOS, Windows): the kernels' modules still
import, the torch and loop backends run, and `backend="triton"` says what is missing."""
import os

# Triton decides at a kernel's definition (this package's import) whether its interpreter runs
# it: TRITON_INTERPRET set later changes nothing for these kernels
INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
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


def cdiv(a: int, b: int) -> int:
    """`triton.cdiv` for host code: Triton's is a ConstexprFunction, about 5 µs a call."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """`triton.next_power_of_2` for host code (0 for n <= 0, as Triton's), likewise."""
    return 1 << (n - 1).bit_length() if n > 0 else 0
