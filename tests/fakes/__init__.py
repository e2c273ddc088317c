"""In-process stand-ins for the outside world that speak the real protocols (fast tests)."""
