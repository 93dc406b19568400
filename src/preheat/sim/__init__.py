"""Fleet simulator: routing and cold-start on virtual time, with the live system's policy code."""
