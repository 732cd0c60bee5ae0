"""The ML step written once for scikit-learn and cuML: features, four models, accuracy."""

from __future__ import annotations

import numpy as np

from fastdl_lab.tabular.backend import Backend, day_of_week, to_numpy

FEATURES = ["distance_km", "duration_min", "hour", "weekday", "passengers", "fare", "card"]
TIP_SHARE = 0.15


def features(trips, be: Backend):
    """``(X, y)`` from raw trips: float32 features of the usable rows, ``y = tip > 15% of fare``.

    Written apart from the graded ETL so that it works before that is solved. Payment is a feature
    (``card``): drivers record card tips, rarely cash ones, so it is the strongest signal there is.
    """
    usable = trips["fare"].notna() & (trips["distance_km"] > 0) & (trips["dropoff_at"] > trips["pickup_at"])
    trips = trips[usable]
    payment = trips["payment"].str.strip().str.lower()
    passengers = trips["passengers"].astype("float64")
    # The median keeps a missing count at a typical value; zero would claim an empty taxi.
    X = be.df.DataFrame({
        "distance_km": trips["distance_km"],
        "duration_min": (trips["dropoff_at"] - trips["pickup_at"]) / np.timedelta64(60, "s"),
        "hour": trips["pickup_at"].dt.hour,
        "weekday": day_of_week(trips["pickup_at"]),
        "passengers": passengers.fillna(passengers.median()),
        "fare": trips["fare"],
        "card": payment == "card",
    })[FEATURES].astype("float32")
    y = (trips["tip"] > TIP_SHARE * trips["fare"]).astype("int32")
    return X.reset_index(drop=True), y.reset_index(drop=True)


def ml_ref(X_train, y_train, X_test, be: Backend) -> dict:
    """Fit the four models on the training rows; predictions for ``X_test`` by model name.

    Logistic regression, k-NN and k-means see standardised features (distances and gradient steps
    would otherwise be ruled by the widest column); the forest splits on raw values.
    """
    ### BEGIN SOLUTION
    scaler = be.ml.StandardScaler().fit(X_train)
    train, test = scaler.transform(X_train), scaler.transform(X_test)
    models = {
        "logistic_regression": (be.ml.LogisticRegression(max_iter=1000), True),
        "knn": (be.ml.KNeighborsClassifier(n_neighbors=15), True),
        "random_forest": (be.ml.RandomForestClassifier(n_estimators=50, max_depth=8, random_state=0), False),
    }
    predictions = {name: model.fit(train if scaled else X_train, y_train).predict(test if scaled else X_test)
                   for name, (model, scaled) in models.items()}
    predictions["kmeans"] = be.ml.KMeans(n_clusters=8, n_init=3, random_state=0).fit(train).predict(test)
    return predictions
    ### END SOLUTION


def accuracy(pred, y) -> float:
    """Fraction of equal labels; any mix of NumPy, CuPy, pandas and cuDF inputs."""
    pred, y = to_numpy(pred).ravel(), to_numpy(y).ravel()
    if pred.shape != y.shape:
        raise ValueError(f"{pred.shape[0]} predictions for {y.shape[0]} labels")
    return float((pred == y).mean())


def majority_rate(y) -> float:
    """The accuracy of always answering the commoner class: the bar a model must clear."""
    share = float(to_numpy(y).mean())
    return max(share, 1.0 - share)


def evaluate(trips, be: Backend, test_size: float = 0.25, seed: int = 0) -> dict:
    """Features, split, :func:`ml_ref`, accuracies: ``{"majority": rate, model: accuracy, ...}``."""
    X, y = features(trips, be)
    X_train, X_test, y_train, y_test = be.ml.train_test_split(X, y, test_size=test_size, random_state=seed)
    predictions = ml_ref(X_train, y_train, X_test, be)
    return {"majority": majority_rate(y_test), **{name: accuracy(p, y_test) for name, p in predictions.items()}}
