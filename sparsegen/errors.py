"""Every error sparsegen raises is a SparsegenError, so callers can catch one type."""
import math


class SparsegenError(Exception):
    """Base class of sparsegen's errors."""


class SpecError(SparsegenError, ValueError):
    """A kernel spec names a combination that no template can generate."""


class InputError(SparsegenError, ValueError):
    """A tensor handed to an op has the wrong dtype, device, shape or layout."""


class ConfigError(SparsegenError, ValueError):
    """A SPARSEGEN_* environment variable holds a value sparsegen does not accept."""


class CompileError(SparsegenError, RuntimeError):
    """NVRTC rejected a generated kernel; carries the log and the dumped source."""

    def __init__(self, kernel_name: str, log: str, source_path: str):
        self.kernel_name = kernel_name
        self.log = log
        self.source_path = source_path
        super().__init__(
            f"NVRTC failed to compile kernel {kernel_name}.\n"
            f"Generated source written to: {source_path}\n--- NVRTC log ---\n{log}"
        )


class LaunchError(SparsegenError, RuntimeError):
    """The CUDA driver refused to load or launch a compiled kernel."""


def expect(condition: bool, expected: str, got: object, error=InputError) -> None:
    """Raise `error("Expected <expected>. Got <got>.")` unless condition holds."""
    if not condition:
        raise error(f"Expected {expected}. Got {got}.")


def integer(value, what: str, error=InputError) -> int:
    """value as an int: an int or anything with __index__ (numpy, 0-d int tensors), not a bool."""
    expect(not isinstance(value, bool) and hasattr(type(value), "__index__"), f"{what} as an int", repr(value), error)
    return value.__index__()


def positive_int(value, what: str, error=InputError) -> int:
    number = integer(value, what, error)
    expect(number >= 1, f"{what} as a positive int", repr(value), error)
    return number


def fraction(value, what: str, error=InputError, zero: bool = True) -> float:
    """value as a float in [0, 1], or (0, 1] without zero (an int or a float, not a bool or NaN)."""
    number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    above_low = 0.0 <= number if zero else 0.0 < number  # False for NaN, as is every comparison
    expect(above_low and number <= 1.0, f"{what} in {'[' if zero else '('}0, 1]", repr(value), error)
    return number
