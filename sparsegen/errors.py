"""Every error sparsegen raises is a SparsegenError, so callers can catch one type."""


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
