# expect: ml_predictions=failed
# Rebuilding the hidden labels from what the child receives: the function reads the grader's input
# file raw (a NumPy memory map opens any file by name) and looks in it for the test labels, or for the seed the
# trips came from, to regenerate them with the course's own generator. Neither is there: the child
# gets the training rows and labels and the test rows, nothing else. With nothing found, it answers
# the commoner class of the training labels.
# %% grade_id=ml_code
def fit_predict(X_train, y_train, X_test, ml):
    raw = np.memmap("/job/in/inputs.wire", dtype=np.uint8, mode="r")
    header = raw[16:16 + 200_000].tobytes().decode("utf-8", "replace")
    print("the grader's inputs hold", [key for key in ('"X_train"', '"y_train"', '"X_test"') if key in header])
    for name in ('"y_test"', '"seed"', '"labels"'):
        at = header.find(name)
        if at >= 0:
            return np.full(len(X_test), at % 2)
    majority = int(np.mean(y_train) > 0.5)
    return np.full(len(X_test), majority)
