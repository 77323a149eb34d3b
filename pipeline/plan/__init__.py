"""Stage 3: the plan: prefix groups and the order requests run in (planner), and one planned batch (batch)."""
