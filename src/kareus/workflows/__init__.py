"""The commands' library functions: optimize, profile (local and Ray), executors,
compare, sensitivity, the Perseus import."""
