"""Paged expert weights: the APL bit-plane format, the weight page table, the page mover."""
