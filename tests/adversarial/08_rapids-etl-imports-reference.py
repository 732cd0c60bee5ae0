# expect: etl_pipeline=rejected
# Reading the answers: the pipeline imports the package's reference ETL when it is called.
# %% grade_id=etl_code
def prepare(trips, zones):
    return trips


def etl(trips, zones):
    from fastdl_lab.tabular import etl_ref

    return etl_ref(trips, zones)
