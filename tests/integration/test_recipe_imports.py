"""The recipe-target check and the recipe packages import nothing heavy (checked in a fresh
interpreter)."""
import subprocess
import sys


def test_recipe_target_check_imports_nothing():
    code = ("import sys; from launcher.config.recipe_target import target_problem; "
            "assert target_problem('recipes.gpt.train.main') is None; "
            "assert target_problem('recipes.gpt.engines.deepspeed.DeepSpeedEngine') is None; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('recipes', 'torch', 'deepspeed')); "
            "sys.exit(f'imported {bad}' if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_recipe_packages_import_light():
    code = ("import sys, recipes, recipes.gpt; bad = [m for m in ('torch', 'deepspeed') if m in sys.modules]; "
            "sys.exit(f'imported {bad}' if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
