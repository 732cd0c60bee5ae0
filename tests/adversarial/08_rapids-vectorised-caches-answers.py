# expect: vectorised=partial
# Pretending to be fast: the row loop, with every answer remembered by the table's content, so that
# a timer that called it again on the same table would see a dictionary lookup.
# %% grade_id=vectorised_code
RUSH_FIRST, RUSH_LAST, SURCHARGE = 16, 19, 2.5


def fare_per_km(trips, seen={}):
    key = (len(trips), float(trips["fare"].sum()), float(trips["distance_km"].sum()))
    if key not in seen:
        values = []
        for _, row in trips.iterrows():
            if row["distance_km"] <= 0 or row["fare"] != row["fare"]:
                values.append(math.nan)
                continue
            surcharge = SURCHARGE if RUSH_FIRST <= row["pickup_at"].hour <= RUSH_LAST else 0.0
            values.append((row["fare"] + surcharge) / row["distance_km"])
        seen[key] = np.array(values)
    return seen[key]
