# expect: roofline=partial
# A degenerate answer: honest calculators, and a compute_bound_batch that always says no batch
# ever reaches the ridge, which is right for a quarter of the hidden layers.
# %% grade_id=roofline_code
def matmul_flops(m, n, k):
    return 2 * m * n * k


def matmul_bytes(m, n, k, bytes_per_elem):
    return (m * k + k * n + m * n) * bytes_per_elem


def arithmetic_intensity(flops, bytes_moved):
    return flops / bytes_moved


def attainable_tflops(intensity, peak_tflops, peak_bw_gbs):
    return min(peak_tflops, intensity * peak_bw_gbs / 1e3)


def mfu(achieved_tflops, peak_tflops):
    return achieved_tflops / peak_tflops


def compute_bound_batch(d_in, d_out, bytes_per_elem, peak_tflops, peak_bw_gbs):
    return None
