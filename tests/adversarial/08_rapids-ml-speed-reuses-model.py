# expect: ml_gpu_speed=failed
# Fast by fitting once: the model is fitted on the first call's rows and kept; every later call only
# predicts, which takes a fraction of a fit. The trips of every call look alike, so the kept model
# should still be accurate, and ml_predictions, graded on one call, sees an honest fit.
# %% grade_id=ml_code
def fit_predict(X_train, y_train, X_test, ml, kept={}):
    if "model" not in kept:
        kept["model"] = ml.RandomForestClassifier(n_estimators=50, max_depth=8, random_state=0).fit(X_train, y_train)
    return kept["model"].predict(X_test)
