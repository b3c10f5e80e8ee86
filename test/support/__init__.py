"""Helpers shared by the tests of several folders (unit/, integration/, real_data/); no tests here.

The folder holding conftest.py (test/) is on sys.path while pytest runs, so a test imports these as
``from support.paths import REPO_ROOT``. A test file never imports another test file.
"""
