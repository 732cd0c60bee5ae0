# expect: roofline=error
# Bloating the batch, and markup: a 20 MB exception message that starts with a script tag.
# %% grade_id=roofline_code
raise ValueError("<script>alert('grades')</script>" + "x" * 20_000_000)
