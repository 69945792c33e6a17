"""Small Triton kernels the tests compile or interpret (kept in a file: Triton reads a
kernel's source)."""

import triton
import triton.language as tl


@triton.jit
def first_negative(x_ptr, out_ptr, n):
    found = -1
    for i in range(n):
        if tl.load(x_ptr + i) < 0:
            found = i
            break  # Python runs this; the Triton compiler has no `break`
    tl.store(out_ptr, found)
