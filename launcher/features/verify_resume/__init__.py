"""`launcher verify-resume`: a run stopped and resumed by the product's own stop path, compared step by
step with the same run straight through (verdict.py: the comparison, pure; tensors.py: the checkpoints'
tensors, in a process of its own; run.py: the runs launched, waited for and judged)."""
