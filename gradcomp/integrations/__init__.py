"""Glue for training frameworks; each module imports its framework only when used."""
