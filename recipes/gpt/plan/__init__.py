"""The planner: pure estimators of parameters, FLOPs, memory, communication and step time for our GPT
on a layout, the layout search, and the pre-submit checks. No torch, no deepspeed (login node).
See docs/planner.md for every formula."""
