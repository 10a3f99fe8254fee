"""Ignition: prepares a checkpoint and exports a Flare runtime core (see proto/ for the format)."""

__version__ = "0.1.0"
