"""`pagedweight serve`: the whole cluster (planner, one worker, gateway) as local processes."""
