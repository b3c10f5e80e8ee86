"""Maintenance tools run from a checkout (``python -m gp_mapping.tools.<name>``); nothing at run time imports them."""
