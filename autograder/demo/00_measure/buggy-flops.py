# A realistic mistake: a multiply-add counted as one FLOP instead of two, and the output matrix
# left out of the bytes a matmul must move; the batch question, reasoned on paper, is right.
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


def compute_bound_batch(d_in, d_out, bytes_per_elem, peak_tflops, peak_bw_gbs):
    # Worked out on paper from the right counts (2 b d_in d_out FLOPs, C included in the bytes).
    ridge = peak_tflops * 1e3 / peak_bw_gbs
    per_batch = 2 * d_in * d_out - ridge * bytes_per_elem * (d_in + d_out)
    if per_batch <= 0:
        return None
    b = ridge * bytes_per_elem * d_in * d_out / per_batch
    return max(1, int(b) + (b > int(b)))
