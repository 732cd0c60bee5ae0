# expect: ml_predictions=rejected
# Reading the answers: walks the interpreter's objects for the test labels the grader holds.
# %% grade_id=ml_code
def fit_predict(X_train, y_train, X_test, ml):
    gc = __import__("gc")
    for obj in gc.get_objects():
        if isinstance(obj, np.ndarray) and obj.shape == (len(X_test),) and obj.dtype.kind == "i":
            return obj
    return np.zeros(len(X_test), dtype=int)
