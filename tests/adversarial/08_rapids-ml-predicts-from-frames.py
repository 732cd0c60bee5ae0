# expect: ml_predictions=rejected
# Reading the answers: starts up the dunder ladder (a function's __code__, an array's internals) that leads to
# the grader's frames, where the test labels live.
# %% grade_id=ml_code
def fit_predict(X_train, y_train, X_test, ml):
    frame = np.zeros(1).__array_interface__
    caller = fit_predict.__code__
    return np.zeros(len(X_test), dtype=int) if frame and caller else None
