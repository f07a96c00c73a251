"""Scheduling quality: which model is served when, simulated and live side by side (open
traffic, bursts, priority lines, callers who give up, placement)."""
