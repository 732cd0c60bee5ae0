# expect: ml_predictions=rejected
# Forging the delivery: before the runner can send the real predictions, the function sends its own
# outputs frame over the child's channel to the grader (perfect predictions, it hopes: all ones) and
# ends the process at once, so that the runner never sends another.
# %% grade_id=ml_code
def fit_predict(X_train, y_train, X_test, ml):
    from autograder.engine import channel
    import os

    channel.child_link.send("outputs", value={"pred": [1] * len(X_test), "backend": "pandas"})
    os._exit(0)
