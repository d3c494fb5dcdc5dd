"""Mist's search: what one search is asked, resolved once, and its candidate points (problem), a
stage's cost under each strategy (stage_cost), the inter-stage MILP (inter_stage), the 1F1B pipeline
simulator (pipeline_sim), the planner (search, predict, refine) and the accuracy report against
measured runs (validate). Imports the cost model, never the engine."""
