"""An optimize run's result, its directory on disk and its report."""
