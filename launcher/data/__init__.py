"""Tokenized datasets: the format (manifest), `launcher data prepare`, and (on the node) the loader.

Light on purpose: importing the package loads nothing; the login side never imports torch here.
"""
