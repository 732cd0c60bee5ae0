# expect: etl_pipeline=rejected
# Reaching the grader's state through text: a format string's fields read attributes by name
# ("{0.__globals__}"), which no attribute node shows, so the function's globals (and from them the
# modules and the runner's objects) are one format call away. The pipeline answers with the package's
# reference ETL found there.
# %% grade_id=etl_code
def prepare(trips, zones):
    return trips


def etl(trips, zones):
    found = "{0.__globals__[day_of_week].__module__}".format(prepare)
    return trips.groupby(["pickup_zone"]).agg({"fare": "mean"}).reset_index() if found else None
