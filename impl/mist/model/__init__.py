"""Mist's cost model: model and cluster specs with explicit fields, the symbolic per-layer analysis,
the runtime and interference models fitted to profiles (with their presets), the profile data
and the memory budgets. No torch; imports nothing else of Mist."""
