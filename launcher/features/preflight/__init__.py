"""launcher preflight: ladder (the rungs and verdicts, pure), climb (the rungs submitted and judged)."""
