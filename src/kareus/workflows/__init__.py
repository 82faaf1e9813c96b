"""The commands' steps: optimize, profile, compare, sensitivity, the Perseus import, the
power-limited baseline, the like-for-like anchors. What measures lives in
`kareus.profiling`."""
