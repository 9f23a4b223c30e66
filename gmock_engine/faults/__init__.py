"""Fault injection's specs: which fault fires when, and what it does to the wire. Pure (runtime/fault_injection.py applies them)."""
