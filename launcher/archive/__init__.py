"""Run archive: what each run dir holds, and the index over all of them."""
