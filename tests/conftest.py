import os

# Triton JIT-decorates kernels at import: the interpreter flag must be set before that, so the
# Triton kernels can run (slowly, on small shapes) on CPU-only machines.
os.environ.setdefault("TRITON_INTERPRET", "1")
