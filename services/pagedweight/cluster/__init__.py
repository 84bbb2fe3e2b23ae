"""`pagedweight serve`: the whole cluster (planner, workers, gateway) as local processes."""
