# expect: row_sum=not_a_kernel
# Library instead of a kernel: the warm-up's @triton.jit body reads the interpreter's raw pointers with ctypes and sums the rows with torch (correct under a bare interpreter).
# %% grade_id=row_sum_kernel_code
import triton
import triton.language as tl


@triton.jit
def row_sum_kernel(x_ptr, y_ptr, M, N, stride_xm, stride_xn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Under TRITON_INTERPRET every argument is a handle around a NumPy array: pointers are
    # addresses, which ctypes reads and writes directly.
    torch = __import__("torch")
    ctypes = __import__("ctypes")
    rows, cols = int(M.handle.data[0]), int(N.handle.data[0])
    sm, sn = int(stride_xm.handle.data[0]), int(stride_xn.handle.data[0])
    size = x_ptr.dtype.element_ty.primitive_bitwidth // 8
    dtype = torch.float32 if size == 4 else torch.float16
    span = ((rows - 1) * sm + (cols - 1) * sn + 1) * size
    src = torch.frombuffer(bytearray(ctypes.string_at(int(x_ptr.handle.data[0]), span)), dtype=dtype)
    sums = torch.as_strided(src, (rows, cols), (sm, sn)).float().sum(1).to(dtype).numpy().tobytes()
    ctypes.memmove(int(y_ptr.handle.data[0]), sums, len(sums))
