"""sweep=asha: schedule (the rule), rungs (a point's report at a rung and the decision carried out)."""
