"""What runs on the node: rank discovery, process-group setup, the recipe call, the outcome."""
