"""Graded-item specifications, one module per lab (lab<NN>_<topic>.py)."""
