# A realistic mistake: a multiply-add counted as one FLOP instead of two, and the output matrix
# left out of the bytes a matmul must move.
# %% grade_id=roofline_code
def matmul_flops(m, n, k):
    return m * n * k


def matmul_bytes(m, n, k, bytes_per_elem):
    return (m * k + k * n) * bytes_per_elem


def arithmetic_intensity(flops, bytes_moved):
    return flops / bytes_moved


def attainable_tflops(intensity, peak_tflops, peak_bw_gbs):
    return min(peak_tflops, intensity * peak_bw_gbs / 1e3)


def mfu(achieved_tflops, peak_tflops):
    return achieved_tflops / peak_tflops
