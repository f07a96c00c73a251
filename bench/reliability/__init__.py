"""Faults, failover, recovery and floods: requests counted through each, and what they cost."""
