"""Where runs are recorded and shown: MLflow runs and sweep parents, run names, the terminal
comparison of a sweep, the console's log lines and bars, and the plots."""
