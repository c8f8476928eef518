"""Shared fixtures. Tests that boot VMs are marked ``qemu``; PostgreSQL ones ``postgres``."""
