# expect: grouped_order=output
# Bloating the batch: prints without end.
# %% grade_id=grouped_order_code
while True:
    print("spam " * 200)
