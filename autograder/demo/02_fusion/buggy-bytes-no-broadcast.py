# A realistic mistake in counting: the subtract and the divide are charged only for the matrix
# they read, not for the one value per row (max, sum) they read beside it. Right for the fused
# kernel, 2M elements short for the five eager ops.
# %% grade_id=softmax_bytes_code
def softmax_bytes(n_rows, n_cols, bytes_per_elem):
    matrix = n_rows * n_cols
    reads = matrix * 5  # max, subtract, exp, sum, divide each read the matrix
    writes = matrix * 3 + n_rows * 2  # subtract, exp, divide write a matrix; max and sum a value per row
    return (reads + writes) * bytes_per_elem, 2 * matrix * bytes_per_elem
