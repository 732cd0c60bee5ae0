"""Lab 08's items on what crosses into a grading child and back: tables as columns, the data an ML
child gets (never its labels or the seed they came from), and the clocked speed items' checks of
each call against the baseline's answer to the same call. No sandbox: the outputs are made here."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from autograder import wire
from autograder.engine.items import Observed
from autograder.labs import lab08_rapids as lab
from fastdl_lab import tabular


def test_trips_and_zones_cross_as_columns_and_come_back_the_same(tmp_path):
    trips, zones = tabular.make_trips(2500, seed=4)
    for name, frame in (("trips", trips), ("zones", zones)):
        path = str(tmp_path / f"{name}.wire")
        wire.dump(lab.table_columns(frame), path)
        pd.testing.assert_frame_equal(lab.table_from_columns(wire.load(path, cap=1 << 30)), frame)


@pytest.mark.parametrize("name, sent", [("etl_pipeline", {"trips", "zones", "rows"}),
                                        ("ml_predictions", {"X_train", "y_train", "X_test"})])
def test_a_child_gets_the_data_it_needs_and_never_the_seed_or_the_labels(name, sent):
    item = lab.LAB.item(name)
    inputs = item.make_inputs(1234, {"rows": 1500})
    assert {key for key in inputs if key not in item.withheld} == sent
    assert "seed" in item.withheld


def test_the_etl_check_grades_the_table_of_the_columns_it_sent():
    item = lab.LAB.item("etl_pipeline")
    inputs = item.make_inputs(77, {"rows": 1500})
    trips, zones = lab.table_from_columns(inputs["trips"]), lab.table_from_columns(inputs["zones"])
    honest = {"table": lab._plain(tabular.etl_ref(trips, zones)), "backend": "pandas"}
    assert lab.etl_check(inputs, honest, {}).fraction == 1
    inner = trips[trips["pickup_zone"].isin(zones["zone_id"])]
    assert lab.etl_check(inputs, {"table": lab._plain(tabular.etl_ref(inner, zones))}, {}).fraction == 0


def _calls(call_inputs, n=4, params=None):
    params = params or {"rows": 1500}
    made = [call_inputs(99, params, i) for i in range(n)]
    return [{k: v for k, v in call.items() if k != "y_test"} for call in made], [{"y_test": c["y_test"]} for c in made
                                                                                   if "y_test" in c]


def _observed(candidate, baseline, kept=None):
    n = len(candidate)
    return Observed(timings={"candidate": candidate, "baseline": baseline, "candidate_s": [0.1] * n,
                             "baseline_s": [0.3] * n, "withheld": kept or [{}] * n})


def test_a_model_fitted_once_and_reused_fails_the_calls_that_ask_another_question():
    calls, kept = _calls(lab.ml_speed_call)
    ml = tabular.backend("cpu").ml
    baseline = [lab._predictions(lab._reference_fit_predict(c["X_train"], c["y_train"], c["X_test"], ml))
                for c in calls]
    honest = lab.ml_speed_check({}, None, {"min_speedup": 2.0}, observed=_observed(baseline, baseline, kept))
    assert honest.fraction == 1 and honest.details["speedup"] == pytest.approx(3.0)
    first = ml.RandomForestClassifier(n_estimators=50, max_depth=8, random_state=0).fit(calls[0]["X_train"],
                                                                                       calls[0]["y_train"])
    reused = [lab._predictions(first.predict(c["X_test"])) for c in calls]
    verdict = lab.ml_speed_check({}, None, {"min_speedup": 2.0}, observed=_observed(reused, baseline, kept))
    assert verdict.fraction == 0 and "hidden test labels" in verdict.reason


def test_an_earlier_etl_answer_scaled_is_not_this_calls():
    calls, _ = _calls(lab.etl_speed_call, n=3)
    inputs = {"rows": 1500, "seed": 5}
    baseline = [lab._etl_run(tabular.etl_ref, tabular.backend("cpu"), inputs)(c) for c in calls]
    first = pd.DataFrame(baseline[0])
    scaled = []
    for table in baseline:
        guess = first.copy()
        guess["trips"] = (guess["trips"] * sum(table["trips"]) / guess["trips"].sum()).round().astype(int)
        scaled.append({k: guess[k].tolist() for k in guess.columns})
    assert lab.etl_speed_check(inputs, None, {}, observed=_observed(baseline, baseline)).fraction == 1
    verdict = lab.etl_speed_check(inputs, None, {}, observed=_observed(scaled, baseline))
    assert verdict.fraction == 0 and "timed call 1" in verdict.reason


def test_speed_calls_differ_from_call_to_call():
    a, b = lab.etl_speed_call(3, {"rows": 800}, 0), lab.etl_speed_call(3, {"rows": 800}, 1)
    assert not np.array_equal(a["fare"], b["fare"], equal_nan=True)
    x, y = lab.ml_speed_call(3, {"rows": 800}, 0), lab.ml_speed_call(3, {"rows": 800}, 1)
    assert x["X_train"].shape[1] == 7 and not np.array_equal(x["X_train"][:5], y["X_train"][:5])
