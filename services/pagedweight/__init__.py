"""PagedWeight: serving Mixture-of-Experts models with paged any-precision expert weights."""
